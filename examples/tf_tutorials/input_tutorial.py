"""TensorFlow's "Distributed Input" tutorial (tensorflow/docs site/en/tutorials/distribute/input.ipynb),
ported to lockstep: `import lockstep as ls`, `tf.distribute.X` -> `ls.X`, `tf.keras` -> `keras`,
TF's logical CPU devices -> `ls.simulate_cpu_devices`. Lines marked `# other:` are the changes
beyond those; `# harness:` lines collect what each cell prints and write it (argv[1]).
"""
import json  # harness:
import sys  # harness:

import lockstep as ls  # first: it selects Keras' JAX backend

import keras
import numpy as np
import os
import tensorflow as tf

printed = []  # harness: what the cells print, as lists


def show(*values):  # harness: print, and keep the values
    print(*values)  # harness:
    printed.append(json.loads(json.dumps(values, default=lambda v: np.asarray(v).tolist())))  # harness:


N_VIRTUAL_DEVICES = 2
ls.simulate_cpu_devices(N_VIRTUAL_DEVICES)  # mechanical: TF's set_logical_device_configuration

global_batch_size = 16
# Create a tf.data.Dataset object.
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)


def train_step(inputs):  # other: no @tf.function
  features, labels = inputs
  return labels - 0.3 * features


# Iterate over the dataset using the for..in construct.
for inputs in dataset:
  show(train_step(inputs))  # harness: print, kept

global_batch_size = 16
mirrored_strategy = ls.MirroredStrategy()

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
# Distribute input using the `experimental_distribute_dataset`.
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
# 1 global batch of data fed to the model in 1 step.
show([mirrored_strategy.experimental_local_results(part) for part in next(iter(dist_dataset))])  # harness: the batch's rows

mirrored_strategy = ls.MirroredStrategy()


def dataset_fn(input_context):
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
  dataset = dataset.shard(
      input_context.num_input_pipelines, input_context.input_pipeline_id)
  dataset = dataset.batch(batch_size)
  dataset = dataset.prefetch(2)  # This prefetches 2 batches per device.
  return dataset


dist_dataset = mirrored_strategy.distribute_datasets_from_function(dataset_fn)

global_batch_size = 16
mirrored_strategy = ls.MirroredStrategy()
dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def train_step(inputs):  # other: no @tf.function
  features, labels = inputs
  return labels - 0.3 * features


for x in dist_dataset:
  # train_step trains the model using the dataset elements
  loss = mirrored_strategy.run(train_step, args=(x,))
  show("Loss is ", mirrored_strategy.experimental_local_results(loss))  # harness: the local results

num_epochs = 10
steps_per_epoch = 5
for epoch in range(num_epochs):
  dist_iterator = iter(dist_dataset)
  for step in range(steps_per_epoch):
    # train_step trains the model using the dataset elements
    loss = mirrored_strategy.run(train_step, args=(next(dist_iterator),))
    # which is the same as
    # loss = mirrored_strategy.run(train_step, args=(dist_iterator.get_next(),))
    show("Loss is ", mirrored_strategy.experimental_local_results(loss))  # harness: the local results

# You can break the loop with `get_next_as_optional` by checking if the Optional contains a value
global_batch_size = 4
steps_per_loop = 5
strategy = ls.MirroredStrategy()

dataset = tf.data.Dataset.range(9).batch(global_batch_size)
distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))


def identity(x):  # other: the tutorial's lambda, defined once (a new lambda each step compiles each step)
  return x  # other:


def train_fn(distributed_iterator):  # other: no @tf.function
  for _ in range(steps_per_loop):  # other: range for tf.range
    optional_data = distributed_iterator.get_next_as_optional()
    if not optional_data.has_value():
      break
    per_replica_results = strategy.run(identity, args=(optional_data.get_value(),))  # other: identity
    show(strategy.experimental_local_results(per_replica_results))  # other: print for tf.print


train_fn(distributed_iterator)

global_batch_size = 16
epochs = 5
steps_per_epoch = 5
mirrored_strategy = ls.MirroredStrategy()

dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def step_fn(inputs):  # other: defined once, outside the train step (TF defines it inside; here each would compile)
  return 2 * inputs


def train_step(per_replica_inputs):  # other: no @tf.function(input_signature=...)
  return mirrored_strategy.run(step_fn, args=(per_replica_inputs,))


for _ in range(epochs):
  iterator = iter(dist_dataset)
  for _ in range(steps_per_epoch):
    output = train_step(next(iterator))
    show([mirrored_strategy.experimental_local_results(o) for o in output])  # other: print for tf.print

strategy = ls.MirroredStrategy()
vocab = ["a", "b", "c", "d", "f"]

with strategy.scope():
  # Create the layer(s) under scope.
  layer = keras.layers.StringLookup(vocabulary=vocab)


def dataset_fn(input_context):
  # a tf.data.Dataset
  dataset = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()

  # Custom your batching, sharding, prefetching, etc.
  global_batch_size = 4
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  dataset = dataset.batch(batch_size)
  dataset = dataset.shard(
      input_context.num_input_pipelines,
      input_context.input_pipeline_id)

  # Apply the preprocessing layer(s) to the tf.data.Dataset
  def preprocess_with_kpl(input):
    return layer(input)

  processed_ds = dataset.map(preprocess_with_kpl)
  return processed_ds


distributed_dataset = strategy.distribute_datasets_from_function(dataset_fn)

# Print out a few example batches.
distributed_dataset_iterator = iter(distributed_dataset)
for _ in range(3):
  show(strategy.experimental_local_results(next(distributed_dataset_iterator)))  # harness: the local results

mirrored_strategy = ls.MirroredStrategy()
dataset_size = 24
batch_size = 6
dataset = tf.data.Dataset.range(dataset_size).enumerate().batch(batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)


def predict(index, inputs):
  outputs = 2 * inputs
  return index, outputs


result = {}
for index, inputs in dist_dataset:
  output_index, outputs = mirrored_strategy.run(predict, args=(index, inputs))
  indices = list(mirrored_strategy.experimental_local_results(output_index))
  rindices = []
  for a in indices:
    rindices.extend(np.asarray(a))  # other: NumPy for a tensor's .numpy()
  outputs = list(mirrored_strategy.experimental_local_results(outputs))
  routputs = []
  for a in outputs:
    routputs.extend(np.asarray(a))  # other: NumPy for a tensor's .numpy()
  for i, value in zip(rindices, routputs):
    result[i] = value

show(sorted((int(k), int(v)) for k, v in result.items()))  # harness: the dict, as pairs

mirrored_strategy = ls.MirroredStrategy()


def value_fn(ctx):
  return tf.constant(ctx.replica_id_in_sync_group)


distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
for _ in range(4):
  result = mirrored_strategy.run(identity, args=(distributed_values,))  # other: identity, defined once
  show(mirrored_strategy.experimental_local_results(result))  # harness: the local results

mirrored_strategy = ls.MirroredStrategy()


def input_gen():
  while True:
    yield np.random.rand(4)


# use Dataset.from_generator
dataset = tf.data.Dataset.from_generator(
    input_gen, output_types=(tf.float32), output_shapes=tf.TensorShape([4]))
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
iterator = iter(dist_dataset)

json.dump(printed, open(sys.argv[1], "w"))  # harness:
