"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial (tensorflow/docs
site/en/tutorials/distribute/custom_training.ipynb), ported to lockstep: `import lockstep as ls`,
`tf.distribute.X` -> `ls.X`, `tf.nn.X` -> `ls.X`, `tf.keras` -> `keras`, offline data of Fashion
MNIST's shapes, and a JAX step where TF uses `GradientTape`: the model's and optimizer's state
passed in and out of `strategy.run` with Keras' stateless API (lines marked `# jax-step:`).
Lines marked `# other:` are the changes beyond those; `# harness:` lines make the run comparable
and write its numbers (argv[1]).
"""
import json  # harness:
import sys  # harness:

import lockstep as ls  # first: it selects Keras' JAX backend

import jax
import keras
import numpy as np
import os
import tensorflow as tf

keras.utils.set_random_seed(0)  # other: the same initial weights and tf.data shuffle order on any device count

rng = np.random.default_rng(0)  # offline data: Fashion MNIST's shapes and dtypes, fewer samples
train_images, train_labels = rng.integers(0, 256, (600, 28, 28)).astype("uint8"), rng.integers(0, 10, 600)
test_images, test_labels = rng.integers(0, 256, (130, 28, 28)).astype("uint8"), rng.integers(0, 10, 130)

# Add a dimension to the array -> new shape == (28, 28, 1)
train_images = train_images[..., None]
test_images = test_images[..., None]

# Scale the images to the [0, 1] range.
train_images = train_images / np.float32(255)
test_images = test_images / np.float32(255)

strategy = ls.MirroredStrategy()
print('Number of devices: {}'.format(strategy.num_replicas_in_sync))

BUFFER_SIZE = len(train_images)

BATCH_SIZE_PER_REPLICA = 64
GLOBAL_BATCH_SIZE = 256  # other: the tutorial's BATCH_SIZE_PER_REPLICA * num_replicas; one global batch to compare runs

EPOCHS = 3  # harness: the tutorial's 10

train_dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)
test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


def create_model():
  regularizer = keras.regularizers.L2(1e-5)
  model = keras.Sequential([
      keras.Input((28, 28, 1)),  # other: Keras 3 builds the model before the stateless step reads its variables
      keras.layers.Conv2D(32, 3,
                          activation='relu',
                          kernel_regularizer=regularizer),
      keras.layers.MaxPooling2D(),
      keras.layers.Conv2D(64, 3,
                          activation='relu',
                          kernel_regularizer=regularizer),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64,
                         activation='relu',
                         kernel_regularizer=regularizer),
      keras.layers.Dense(10, kernel_regularizer=regularizer)
    ])

  return model


# Create a checkpoint directory to store the checkpoints.
checkpoint_dir = './training_checkpoints'
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")
os.makedirs(checkpoint_dir, exist_ok=True)  # other: TF's checkpoint.save makes the directory

with strategy.scope():
  # Set reduction to `NONE` so you can do the reduction yourself.
  loss_object = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True,
      reduction=None)

  def compute_loss(labels, predictions, model_losses):
    per_example_loss = loss_object(labels, predictions)
    loss = ls.compute_average_loss(per_example_loss)
    if model_losses:
      loss += ls.scale_regularization_loss(sum(model_losses))
    return loss

with strategy.scope():
  test_loss = keras.metrics.Mean(name='test_loss')

  train_accuracy = keras.metrics.SparseCategoricalAccuracy(
      name='train_accuracy')
  test_accuracy = keras.metrics.SparseCategoricalAccuracy(
      name='test_accuracy')

# A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
with strategy.scope():
  model = create_model()

  optimizer = keras.optimizers.Adam(learning_rate=0.001)
  optimizer.build(model.trainable_variables)  # jax-step: the stateless step takes the optimizer's variables

state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],  # jax-step:
         [v.value for v in optimizer.variables])  # jax-step: the state GradientTape's step reads and writes in place


def train_step(state, inputs):  # jax-step: takes and returns the state
  images, labels = inputs
  trainable, non_trainable, optimizer_variables = state  # jax-step:

  def loss_fn(trainable):  # jax-step: the JAX step where TF records a GradientTape
    predictions, non_trainable_new, losses = model.stateless_call(  # jax-step:
        trainable, non_trainable, images, training=True, return_losses=True)  # jax-step:
    loss = compute_loss(labels, predictions, losses)
    return loss, (predictions, non_trainable_new)  # jax-step:

  (loss, (predictions, non_trainable)), gradients = jax.value_and_grad(loss_fn, has_aux=True)(trainable)  # jax-step:
  trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, gradients, trainable)  # jax-step:

  train_accuracy.update_state(labels, predictions)
  return loss, (trainable, non_trainable, optimizer_variables)  # jax-step: the new state


def test_step(state, inputs):  # jax-step: takes the state
  images, labels = inputs

  predictions, _ = model.stateless_call(state[0], state[1], images, training=False)  # jax-step:
  t_loss = loss_object(labels, predictions)

  test_loss.update_state(t_loss)
  test_accuracy.update_state(labels, predictions)


# `run` replicates the provided computation and runs it
# with the distributed input.
def distributed_train_step(state, dataset_inputs):  # other: no @tf.function (run compiles it); jax-step: the state
  per_replica_losses, state = strategy.run(train_step, args=(state, dataset_inputs,))  # jax-step: state
  return strategy.reduce(ls.ReduceOp.SUM, per_replica_losses,
                         axis=None), state  # jax-step: state


def distributed_test_step(state, dataset_inputs):  # other: no @tf.function; jax-step: the state
  return strategy.run(test_step, args=(state, dataset_inputs,))  # jax-step: state


log = []  # harness:
for epoch in range(EPOCHS):
  # TRAIN LOOP
  total_loss = 0.0
  num_batches = 0
  for x in train_dist_dataset:
    loss, state = distributed_train_step(state, x)  # jax-step: the state
    total_loss += loss  # jax-step: (the two lines above were one)
    num_batches += 1
  train_loss = total_loss / num_batches

  # TEST LOOP
  for x in test_dist_dataset:
    distributed_test_step(state, x)  # jax-step: the state

  if epoch % 2 == 0:
    for variable, value in zip(model.variables, state[0] + state[1]):  # jax-step: the state into the model, as in place
      variable.assign(np.asarray(value))  # jax-step:
    model.save_weights(checkpoint_prefix + f"-{epoch}.weights.h5")  # other: checkpoint.save(checkpoint_prefix)

  template = ("Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, "
              "Test Accuracy: {}")
  print(template.format(epoch + 1, train_loss,
                         train_accuracy.result() * 100, test_loss.result(),
                         test_accuracy.result() * 100))
  log.append([float(train_loss), float(train_accuracy.result()), float(test_loss.result()),  # harness:
              float(test_accuracy.result())])  # harness:

  test_loss.reset_state()  # other: Keras 3's name (reset_states)
  train_accuracy.reset_state()  # other:
  test_accuracy.reset_state()  # other:

eval_accuracy = keras.metrics.SparseCategoricalAccuracy(
      name='eval_accuracy')

new_model = create_model()
new_optimizer = keras.optimizers.Adam()

test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)


def eval_step(images, labels):  # other: no @tf.function
  predictions = new_model(images, training=False)
  eval_accuracy(labels, predictions)


new_model.load_weights(checkpoint_prefix + f"-{EPOCHS - 1 - (EPOCHS - 1) % 2}.weights.h5")  # other: tf.train.Checkpoint restore

for images, labels in test_dataset:
  eval_step(images, labels)

print('Accuracy after restoring the saved model without strategy: {}'.format(
    eval_accuracy.result() * 100))

json.dump({"epochs": log, "restored_accuracy": float(eval_accuracy.result())}, open(sys.argv[1], "w"))  # harness:
