"""TensorFlow's "Save and load a model using a distribution strategy" tutorial (tensorflow/docs
site/en/tutorials/distribute/save_and_load.ipynb): its Keras API sections (`model.save` /
`keras.models.load_model` in and out of a strategy's scope), ported to lockstep: `import lockstep
as ls`, `tf.distribute.X` -> `ls.X`, `tf.keras` -> `keras`, offline data of MNIST's shapes. Its
`tf.saved_model` and TF Hub sections are TF's own formats, which Keras 3 on JAX has no
counterpart of: not ported. Lines marked `# other:` are the changes beyond those; `# harness:`
lines make the run comparable and write its numbers (argv[1]).
"""
import json  # harness:
import sys  # harness:

import lockstep as ls  # first: it selects Keras' JAX backend

import keras
import numpy as np
import tensorflow as tf

keras.utils.set_random_seed(0)  # other: the same initial weights and tf.data shuffle order on any device count

mirrored_strategy = ls.MirroredStrategy()


def get_data():
  rng = np.random.default_rng(0)  # offline data: MNIST's shapes and dtypes, fewer samples
  mnist_train = tf.data.Dataset.from_tensor_slices((rng.integers(0, 256, (600, 28, 28, 1)).astype("uint8"),
                                                    rng.integers(0, 10, 600).astype("int64")))
  mnist_test = tf.data.Dataset.from_tensor_slices((rng.integers(0, 256, (130, 28, 28, 1)).astype("uint8"),
                                                   rng.integers(0, 10, 130).astype("int64")))

  BUFFER_SIZE = 10000

  BATCH_SIZE_PER_REPLICA = 64
  BATCH_SIZE = 256  # other: the tutorial's BATCH_SIZE_PER_REPLICA * num_replicas; one global batch to compare runs

  def scale(image, label):
    image = tf.cast(image, tf.float32)
    image /= 255

    return image, label

  train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
  eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

  return train_dataset, eval_dataset


def get_model():
  with mirrored_strategy.scope():
    model = keras.Sequential([
        keras.layers.Conv2D(32, 3, activation='relu', input_shape=(28, 28, 1)),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation='relu'),
        keras.layers.Dense(10)
    ])

    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


model = get_model()
train_dataset, eval_dataset = get_data()
results = {"fit": model.fit(train_dataset, epochs=2).history}  # harness: kept

keras_model_path = 'keras_save.keras'  # harness: the tutorial's '/tmp/keras_save.keras'
model.save(keras_model_path)

restored_keras_model = keras.models.load_model(keras_model_path)
results["restored"] = restored_keras_model.fit(train_dataset, epochs=2).history  # harness: kept

another_strategy = ls.OneDeviceStrategy('/cpu:0')
with another_strategy.scope():
  restored_keras_model_ds = keras.models.load_model(keras_model_path)
  results["restored_ds"] = restored_keras_model_ds.fit(train_dataset, epochs=2).history  # harness: kept

results["replicas"] = mirrored_strategy.num_replicas_in_sync  # harness:
json.dump(results, open(sys.argv[1], "w"))  # harness:
