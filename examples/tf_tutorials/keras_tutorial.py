"""TensorFlow's "Distributed training with Keras" tutorial (tensorflow/docs
site/en/tutorials/distribute/keras.ipynb), ported to lockstep with mechanical changes only:
`import lockstep as ls`, `tf.distribute.X` -> `ls.X`, `tf.keras` -> `keras`, offline data of the
same shapes instead of `tfds.load("mnist")`, notebook magics (`%tensorboard`, `!ls`) dropped.
Lines marked `# other:` are the changes beyond those (docs/from-tf-distribute.md counts them);
`# harness:` lines make the run comparable and write its numbers (argv[1]).
"""
import json  # harness:
import os
import sys  # harness:

import lockstep as ls  # first: it selects Keras' JAX backend

import keras
import numpy as np
import tensorflow as tf

keras.utils.set_random_seed(0)  # other: the same initial weights and tf.data shuffle order on any device count
N_TRAIN, N_TEST = int(os.environ.get("TUTORIAL_N_TRAIN", 600)), 130  # harness: smaller than MNIST's 60000 / 10000

rng = np.random.default_rng(0)  # offline data: MNIST's shapes and dtypes
mnist_train = tf.data.Dataset.from_tensor_slices((rng.integers(0, 256, (N_TRAIN, 28, 28, 1)).astype("uint8"),
                                                  rng.integers(0, 10, N_TRAIN).astype("int64")))
mnist_test = tf.data.Dataset.from_tensor_slices((rng.integers(0, 256, (N_TEST, 28, 28, 1)).astype("uint8"),
                                                 rng.integers(0, 10, N_TEST).astype("int64")))

strategy = ls.MirroredStrategy()
print('Number of devices: {}'.format(strategy.num_replicas_in_sync))

num_train_examples = N_TRAIN
num_test_examples = N_TEST

BUFFER_SIZE = 10000

BATCH_SIZE_PER_REPLICA = 64
BATCH_SIZE = 256  # other: the tutorial's BATCH_SIZE_PER_REPLICA * num_replicas; one global batch to compare runs


def scale(image, label):
  image = tf.cast(image, tf.float32)
  image /= 255

  return image, label


train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

with strategy.scope():
  model = keras.Sequential([
      keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation='relu'),
      keras.layers.Dense(10)
  ])

  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=keras.optimizers.Adam(learning_rate=0.001),
                metrics=['accuracy'])

# Define the checkpoint directory to store the checkpoints.
checkpoint_dir = './training_checkpoints'
# Define the name of the checkpoint files.
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.h5")


# Define a function for decaying the learning rate.
# You can define any decay function you need.
def decay(epoch):
  if epoch < 3:
    return 1e-3
  elif epoch >= 3 and epoch < 7:
    return 1e-4
  else:
    return 1e-5


# Define a callback for printing the learning rate at the end of each epoch.
class PrintLR(keras.callbacks.Callback):
  def on_epoch_end(self, epoch, logs=None):
    print('\nLearning rate for epoch {} is {}'.format(epoch + 1, model.optimizer.learning_rate.numpy()))


# Put all the callbacks together.
callbacks = [
    keras.callbacks.TensorBoard(log_dir='./logs'),
    keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix,
                                    save_weights_only=True),
    keras.callbacks.LearningRateScheduler(decay),
    PrintLR()
]

EPOCHS = 12

history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)  # harness: keeps the History

import pathlib
latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob('*'))[-1]

model.load_weights(latest_checkpoint)

eval_loss, eval_acc = model.evaluate(eval_dataset)

print('Eval loss: {}, Eval accuracy: {}'.format(eval_loss, eval_acc))

path = 'my_model.keras'
model.save(path)

unreplicated_model = keras.models.load_model(path)

unreplicated_model.compile(
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizer=keras.optimizers.Adam(),
    metrics=['accuracy'])

eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)

print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss, eval_acc))

with strategy.scope():
  replicated_model = keras.models.load_model(path)
  replicated_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           optimizer=keras.optimizers.Adam(),
                           metrics=['accuracy'])

  eval_loss_r, eval_acc_r = replicated_model.evaluate(eval_dataset)  # harness: kept apart from the above
  print('Eval loss: {}, Eval Accuracy: {}'.format(eval_loss_r, eval_acc_r))

json.dump({"history": history.history, "evaluate": [eval_loss, eval_acc], "replicated": [eval_loss_r, eval_acc_r],  # harness:
           "checkpoints": len(list(pathlib.Path(checkpoint_dir).glob('*')))}, open(sys.argv[1], "w"))  # harness:
