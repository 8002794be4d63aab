"""TensorFlow's "Distributed training with TensorFlow" guide (tensorflow/docs
site/en/guide/distributed_training.ipynb), ported to lockstep: `import lockstep as ls`,
`tf.distribute.X` -> `ls.X`, `tf.keras` -> `keras`, `tf.nn.X` -> `ls.X`, and a JAX step where the
guide records a `GradientTape` (lines marked `# jax-step:`). Lines marked `# other:` are the changes
beyond those; `# harness:` lines make the run comparable and write its numbers (argv[1]).
"""
import json  # harness:
import sys  # harness:

import lockstep as ls  # first: it selects Keras' JAX backend

import jax  # jax-step: the step's gradient
import keras
import tensorflow as tf

keras.utils.set_random_seed(0)  # other: the same initial weights on any device count
results = {}  # harness:

mirrored_strategy = ls.MirroredStrategy()
# other: the guide's `MirroredStrategy(devices=["/gpu:0", "/gpu:1"])`: refused on a machine without them
mirrored_strategy = ls.MirroredStrategy(
    cross_device_ops=ls.HierarchicalCopyAllReduce())
strategy = ls.MultiWorkerMirroredStrategy()
communication_options = ls.experimental.CommunicationOptions(
    implementation=ls.experimental.CommunicationImplementation.NCCL)
strategy = ls.MultiWorkerMirroredStrategy(
    communication_options=communication_options)
central_storage_strategy = ls.experimental.CentralStorageStrategy()
default_strategy = ls.get_strategy()

# In optimizer or other library code
# Get currently active strategy
strategy = ls.get_strategy()
results["reduce"] = float(strategy.reduce("SUM", 1., axis=None))  # reduce some values  # harness: kept

if tf.config.list_physical_devices('GPU'):
  strategy = ls.MirroredStrategy()
else:  # Use the Default Strategy
  strategy = ls.get_strategy()

with strategy.scope():
  # Do something interesting
  print(keras.Variable(1.))  # other: a Keras variable for tf.Variable

mirrored_strategy = ls.MirroredStrategy()
with mirrored_strategy.scope():
  model = keras.Sequential([
      keras.layers.Dense(1, input_shape=(1,),
                         kernel_regularizer=keras.regularizers.L2(1e-4))])
  model.compile(loss='mse', optimizer='sgd')

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(10)
results["fit_dataset"] = model.fit(dataset, epochs=2).history  # harness: kept
results["evaluate"] = model.evaluate(dataset)  # harness: kept

import numpy as np
inputs, targets = np.ones((100, 1)), np.ones((100, 1))
results["fit_arrays"] = model.fit(inputs, targets, epochs=2, batch_size=10).history  # harness: kept

mirrored_strategy.num_replicas_in_sync

# Compute a global batch size using a number of replicas.
BATCH_SIZE_PER_REPLICA = 5
global_batch_size = 20  # other: the guide's BATCH_SIZE_PER_REPLICA * num_replicas; one global batch to compare runs
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100)
dataset = dataset.batch(global_batch_size)

LEARNING_RATES_BY_BATCH_SIZE = {5: 0.1, 10: 0.15, 20:0.175}
learning_rate = LEARNING_RATES_BY_BATCH_SIZE[global_batch_size]

with mirrored_strategy.scope():
  model = keras.Sequential([
      keras.layers.Dense(1, input_shape=(1,),
                         kernel_regularizer=keras.regularizers.L2(1e-4))])
  optimizer = keras.optimizers.SGD()
  optimizer.build(model.trainable_variables)  # jax-step: the stateless step takes the optimizer's variables

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(1000).batch(
    global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

# Sets `reduction=NONE` to leave it to tf.nn.compute_average_loss() below.
loss_object = keras.losses.BinaryCrossentropy(
  from_logits=True,
  reduction=None)  # other: Keras 3's None for tf.keras.losses.Reduction.NONE

state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],  # jax-step
         [v.value for v in optimizer.variables])  # jax-step: the state GradientTape's step updates in place


def train_step(state, inputs):  # jax-step: the state in
  features, labels = inputs
  trainable, non_trainable, optimizer_variables = state  # jax-step

  def loss_fn(trainable):  # jax-step: for the GradientTape
    predictions, non_trainable_new, model_losses = model.stateless_call(  # jax-step
        trainable, non_trainable, features, training=True, return_losses=True)  # jax-step
    per_example_loss = loss_object(labels, predictions)
    loss = ls.compute_average_loss(per_example_loss)
    if model_losses:
      loss += ls.scale_regularization_loss(sum(model_losses))  # other: sum for tf.add_n
    return loss, non_trainable_new  # jax-step

  (loss, non_trainable), gradients = jax.value_and_grad(loss_fn, has_aux=True)(trainable)  # jax-step
  trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, gradients, trainable)  # jax-step
  return loss, (trainable, non_trainable, optimizer_variables)  # jax-step: the state out


def distributed_train_step(state, dist_inputs):  # other: no @tf.function; jax-step: the state
  per_replica_losses, state = mirrored_strategy.run(train_step, args=(state, dist_inputs,))  # jax-step
  return mirrored_strategy.reduce(ls.ReduceOp.SUM, per_replica_losses,
                         axis=None), state  # jax-step

losses = []  # harness:
for dist_inputs in dist_dataset:
  loss, state = distributed_train_step(state, dist_inputs)  # jax-step
  print(loss)  # jax-step: the step returns the state too
  losses.append(float(loss))  # harness:

iterator = iter(dist_dataset)
for _ in range(10):
  loss, state = distributed_train_step(state, next(iterator))  # jax-step
  print(loss)  # jax-step: the step returns the state too
  losses.append(float(loss))  # harness:

results["custom_loop"] = losses  # harness:
results["replicas"] = mirrored_strategy.num_replicas_in_sync  # harness:
json.dump(results, open(sys.argv[1], "w"))  # harness:
