"""TensorFlow's "Custom training loop with Keras and MultiWorkerMirroredStrategy" tutorial
(tensorflow/docs site/en/tutorials/distribute/multi_worker_with_ctl.ipynb): its `mnist.py` and
`main.py`, ported to lockstep: `import lockstep as ls`, `tf.distribute.X` -> `ls.X`, `tf.keras` ->
`keras`, `tf.nn.X` -> `ls.X`, offline data of MNIST's shapes, and a JAX step where the tutorial
records a `GradientTape` (lines marked `# jax-step`). Every worker runs this file with its
TF_CONFIG. Lines marked `# other:` are the changes beyond those; `# harness:` lines make the run
comparable and write its numbers (argv[1]).
"""
import json
import os
import sys  # harness:

import lockstep as ls  # first: it selects Keras' JAX backend

import jax  # jax-step: the step's gradient
import keras
import numpy as np
import tensorflow as tf

STEPS = int(os.environ.get("TUTORIAL_STEPS", 70))  # harness: the tutorial's num_steps_per_epoch=70


# --- mnist.py
def mnist_dataset(batch_size):
  rng = np.random.default_rng(0)  # offline data: MNIST's shapes and dtypes, fewer samples
  x_train, y_train = rng.integers(0, 256, (600, 28, 28)).astype("uint8"), rng.integers(0, 10, 600).astype("uint8")
  # The `x` arrays are in uint8 and have values in the range [0, 255].
  # You need to convert them to float32 with values in the range [0, 1]
  x_train = x_train / np.float32(255)
  y_train = y_train.astype(np.int64)
  train_dataset = tf.data.Dataset.from_tensor_slices(
      (x_train, y_train)).shuffle(60000, seed=0)  # other: seed (the one-worker run reads the same rows)
  return train_dataset


def dataset_fn(global_batch_size, input_context):
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  dataset = mnist_dataset(batch_size)
  dataset = dataset.shard(input_context.num_input_pipelines,
                          input_context.input_pipeline_id)
  dataset = dataset.batch(batch_size)
  return dataset.repeat()  # other: TF's iterator is made anew each epoch from an endless list of steps


def build_cnn_model():
  keras.utils.set_random_seed(0)  # harness: the same initial weights in the one-worker run
  regularizer = keras.regularizers.L2(1e-5)
  return keras.Sequential([
      keras.Input(shape=(28, 28)),
      keras.layers.Reshape(target_shape=(28, 28, 1)),
      keras.layers.Conv2D(32, 3,
                          activation='relu',
                          kernel_regularizer=regularizer),
      keras.layers.Flatten(),
      keras.layers.Dense(128,
                         activation='relu',
                         kernel_regularizer=regularizer),
      keras.layers.Dense(10, kernel_regularizer=regularizer)
  ])


# --- main.py
per_worker_batch_size = 64
tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])

global_batch_size = 128  # other: the tutorial's per_worker_batch_size * num_workers; one global batch to compare runs

num_epochs = 3
num_steps_per_epoch = STEPS  # harness: the tutorial's 70


def _is_chief(task_type, task_id, cluster_spec):
  return (task_type is None
          or task_type == 'chief'
          or (task_type == 'worker'
              and task_id == 0
              and 'chief' not in cluster_spec.as_dict()))


def _get_temp_dir(dirpath, task_id):
  base_dirpath = 'workertemp_' + str(task_id)
  temp_dir = os.path.join(dirpath, base_dirpath)
  tf.io.gfile.makedirs(temp_dir)
  return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
  dirpath = os.path.dirname(filepath)
  base = os.path.basename(filepath)
  if not _is_chief(task_type, task_id, cluster_spec):
    dirpath = _get_temp_dir(dirpath, task_id)
  return os.path.join(dirpath, base)


checkpoint_dir = os.path.join(os.path.dirname(sys.argv[1]), 'ckpt')  # harness: the tutorial's temp dir

# Define Strategy
strategy = ls.MultiWorkerMirroredStrategy()

with strategy.scope():
  # Model building/compiling need to be within `tf.distribute.Strategy.scope`.
  multi_worker_model = build_cnn_model()

  multi_worker_dataset = strategy.distribute_datasets_from_function(
      lambda input_context: dataset_fn(global_batch_size, input_context))
  optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
  optimizer.build(multi_worker_model.trainable_variables)  # jax-step: the stateless step takes its variables
  train_accuracy = keras.metrics.SparseCategoricalAccuracy(
      name='train_accuracy')

state = ([v.value for v in multi_worker_model.trainable_variables],  # jax-step
         [v.value for v in multi_worker_model.non_trainable_variables],  # jax-step
         [v.value for v in optimizer.variables])  # jax-step: the state GradientTape's step updates in place


def step_fn(state, inputs):  # other: defined once, outside the train step (each new one compiles); jax-step: state
  """Per-Replica step function."""
  x, y = inputs
  trainable, non_trainable, optimizer_variables = state  # jax-step

  def loss_fn(trainable):  # jax-step: for the GradientTape
    predictions, non_trainable_new, model_losses = multi_worker_model.stateless_call(  # jax-step
        trainable, non_trainable, x, training=True, return_losses=True)  # jax-step
    per_example_loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True,
        reduction=None)(y, predictions)  # other: Keras 3's None for Reduction.NONE
    loss = ls.compute_average_loss(per_example_loss)
    if model_losses:
      loss += ls.scale_regularization_loss(sum(model_losses))  # other: sum for tf.add_n
    return loss, (predictions, non_trainable_new)  # jax-step

  (loss, (predictions, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)  # jax-step
  trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads, trainable)  # jax-step
  train_accuracy.update_state(y, predictions)
  return loss, (trainable, non_trainable, optimizer_variables)  # jax-step: the state out


def train_step(state, iterator):  # other: no @tf.function; jax-step: the state
  """Training step function."""
  per_replica_losses, state = strategy.run(step_fn, args=(state, next(iterator),))  # jax-step
  return strategy.reduce(
      ls.ReduceOp.SUM, per_replica_losses, axis=None), state  # jax-step


epoch = 0  # other: a Python int for tf.Variable (backed up below)
step_in_epoch = 0  # other:

task_type, task_id, cluster_spec = (strategy.cluster_resolver.task_type,
                                    strategy.cluster_resolver.task_id,
                                    strategy.cluster_resolver.cluster_spec())

write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                      cluster_spec)
latest_checkpoint = os.path.join(checkpoint_dir, "ckpt.npz")  # other: tf.train.latest_checkpoint
if os.path.exists(latest_checkpoint):  # other: checkpoint.restore
  saved = np.load(latest_checkpoint)  # other:
  state = tuple([saved[f"{i}_{j}"] for j in range(len(part))] for i, part in enumerate(state))  # other:
  epoch, step_in_epoch = int(saved["epoch"]), int(saved["step_in_epoch"])  # other:

log = []  # harness:
iterator = iter(multi_worker_dataset)  # other: one iterator, as the repeated dataset
while epoch < num_epochs:  # other: epoch for epoch.numpy()
  total_loss = 0.0
  num_batches = 0
  while step_in_epoch < num_steps_per_epoch:  # other: step_in_epoch for step_in_epoch.numpy()
    loss, state = train_step(state, iterator)  # jax-step
    total_loss += loss  # jax-step: (the two lines above were one)
    num_batches += 1
    step_in_epoch += 1  # other: += for assign_add
  train_loss = total_loss / num_batches
  print('Epoch: %d, accuracy: %f, train_loss: %f.'
                %(epoch, train_accuracy.result(), train_loss))  # other: epoch for epoch.numpy()
  log.append([float(train_accuracy.result()), float(train_loss)])  # harness:
  train_accuracy.reset_state()  # other: Keras 3's name

  # Once the `CheckpointManager` is set up, you're now ready to save, and remove
  # the checkpoints non-chief workers saved.
  os.makedirs(write_checkpoint_dir, exist_ok=True)  # other: checkpoint_manager.save(), every worker as in TF
  np.savez(os.path.join(write_checkpoint_dir, "ckpt.npz"), epoch=epoch + 1, step_in_epoch=0,  # other:
           **{f"{i}_{j}": np.asarray(a) for i, part in enumerate(state) for j, a in enumerate(part)})  # other:
  if not _is_chief(task_type, task_id, cluster_spec):
    tf.io.gfile.rmtree(write_checkpoint_dir)
  epoch += 1  # other: += for assign_add
  step_in_epoch = 0  # other: = for assign

json.dump(log, open(f"{sys.argv[1]}.{strategy.worker_index}", "w"))  # harness:
