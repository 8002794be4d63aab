"""TensorFlow's "Multi-worker training with Keras" tutorial (tensorflow/docs
site/en/tutorials/distribute/multi_worker_with_keras.ipynb): its `mnist_setup.py` and `main.py`,
the model saving and `BackupAndRestore` sections, ported to lockstep: `import lockstep as ls`,
`tf.distribute.X` -> `ls.X`, `tf.keras` -> `keras`, offline data of MNIST's shapes. Every worker
runs this file with its TF_CONFIG, as in the tutorial. Lines marked `# other:` are the changes
beyond those; `# harness:` lines make the run comparable and write its numbers (argv[1]).
The `tf.train.Checkpoint` section is TF's own checkpoint format of TF variables: not ported.
"""
import json
import os
import sys  # harness:

import lockstep as ls  # first: it selects Keras' JAX backend

import keras
import numpy as np
import tensorflow as tf

STEPS = int(os.environ.get("TUTORIAL_STEPS", 70))  # harness: the tutorial's steps_per_epoch=70


# --- mnist_setup.py
def mnist_dataset(batch_size):
  rng = np.random.default_rng(0)  # offline data: MNIST's shapes and dtypes, fewer samples
  x_train, y_train = rng.integers(0, 256, (600, 28, 28)).astype("uint8"), rng.integers(0, 10, 600).astype("uint8")
  # The `x` arrays are in uint8 and have values in the [0, 255] range.
  # You need to convert them to float32 with values in the [0, 1] range.
  x_train = x_train / np.float32(255)
  y_train = y_train.astype(np.int64)
  train_dataset = tf.data.Dataset.from_tensor_slices(
      (x_train, y_train)).shuffle(60000, seed=0).repeat().batch(batch_size)  # other: seed (every worker, one order)
  return train_dataset


def build_and_compile_cnn_model():
  keras.utils.set_random_seed(0)  # harness: the same initial weights in the one-worker run
  model = keras.Sequential([
      keras.layers.InputLayer(input_shape=(28, 28)),
      keras.layers.Reshape(target_shape=(28, 28, 1)),
      keras.layers.Conv2D(32, 3, activation='relu'),
      keras.layers.Flatten(),
      keras.layers.Dense(128, activation='relu'),
      keras.layers.Dense(10)
  ])
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=keras.optimizers.SGD(learning_rate=0.001),
      metrics=['accuracy'])
  return model


# --- main.py
per_worker_batch_size = 64
tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])

strategy = ls.MultiWorkerMirroredStrategy()

global_batch_size = 128  # other: the tutorial's per_worker_batch_size * num_workers; one global batch to compare runs
multi_worker_dataset = mnist_dataset(global_batch_size)

with strategy.scope():
  # Model building/compiling need to be within `strategy.scope()`.
  multi_worker_model = build_and_compile_cnn_model()

history = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=STEPS)  # harness: keeps the History

# --- model saving
model_path = '/tmp/keras-model.keras' if len(sys.argv) < 3 else sys.argv[2]  # other: Keras 3's .keras suffix


def _is_chief(task_type, task_id):
  return (task_type == 'worker' and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
  base_dirpath = 'workertemp_' + str(task_id)
  temp_dir = os.path.join(dirpath, base_dirpath)
  tf.io.gfile.makedirs(temp_dir)
  return temp_dir


def write_filepath(filepath, task_type, task_id):
  dirpath = os.path.dirname(filepath)
  base = os.path.basename(filepath)
  if not _is_chief(task_type, task_id):
    dirpath = _get_temp_dir(dirpath, task_id)
  return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type,
                      strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)

multi_worker_model.save(write_model_path)
trained = multi_worker_model.get_weights()  # harness:

if not _is_chief(task_type, task_id):
  tf.io.gfile.rmtree(os.path.dirname(write_model_path))

loaded_model = keras.models.load_model(model_path)

# --- BackupAndRestore
backup_dir = os.path.join(os.path.dirname(model_path), 'backup')  # harness: the tutorial's '/tmp/backup'
callbacks = [keras.callbacks.BackupAndRestore(backup_dir=backup_dir)]
with strategy.scope():
  multi_worker_model = build_and_compile_cnn_model()
backed_up = multi_worker_model.fit(multi_worker_dataset,  # harness: keeps the History
                                   epochs=3,
                                   steps_per_epoch=STEPS,
                                   callbacks=callbacks)

json.dump({"history": history.history, "backed_up": backed_up.history, "task": [task_type, task_id],  # harness:
           "loaded_equal": all(np.array_equal(a, b) for a, b in zip(loaded_model.get_weights(), trained))},  # harness:
          open(f"{sys.argv[1]}.{strategy.worker_index}", "w"))  # harness:
