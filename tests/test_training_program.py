"""Unit tests of the training program (`lockstep.training._executions`): the gradient step, the
state layout (whole or sharded, padded) and the micro-batch wrapper, against NumPy's gradient of
a linear model's mean squared error, batch by batch, with padding rows and replicas without rows."""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lockstep as ls
from lockstep.data import accumulation_groups
from lockstep.metrics import Mean, MetricCollection
from lockstep.sharding import state_layout
from lockstep.training._executions import make_program, runs
from lockstep.training._step_runner import StepRunner
from lockstep.training._steps import make_gradient_step
from lockstep.training._train_state import TrainState

LR = 0.1
_PATHS = {"trainable": {"w": "w", "b": "b"}, "non_trainable": {}}


def _apply(params, x, training):
    return x @ params["trainable"]["w"] + params["trainable"]["b"], params["non_trainable"], None


def _loss(y, y_pred):
    return jnp.sum((y - y_pred) ** 2, axis=-1)


def _numpy_step(w, b, xs, ys):
    """One SGD step of one device on the rows of all `xs` (the mean squared error's own gradient)."""
    x, y = np.concatenate(xs), np.concatenate(ys)
    err = x @ w + b - y
    return w - LR * 2 * x.T @ err / len(x), b - LR * 2 * err.sum(0) / len(x)


def _strategy(kind):
    if kind == "replicated":
        return ls.MirroredStrategy(4)
    mesh = ls.DeviceMesh((4, 2), ("batch", "model"))
    rules = ls.LayoutMap(mesh)
    rules["w"] = (None, "model")  # 3 columns over 2: stored padded; ZeRO pads 5 rows over 4 replicas
    return ls.ShardedStrategy(mesh=mesh, layout_map=rules, zero_stage=int(kind[-1]), min_shard_size=1,
                              max_replicated_fraction=1.0)


def _placed(engine, x, y, padded):
    """A global batch of `x`, `y` padded to `padded` rows (padding repeats row 0), split over the replicas."""
    n = len(x)
    idx = np.concatenate([np.arange(n), np.zeros(padded - n, int)])
    rows = NamedSharding(engine.mesh, P(engine.batch_axis))
    mask = (np.arange(padded) < n).astype(np.float32)
    return ((jax.device_put(x[idx], rows), jax.device_put(y[idx], rows)), jax.device_put(mask, rows),
            jax.device_put(np.float32(n), NamedSharding(engine.mesh, P())))


@pytest.mark.parametrize("kind", ["replicated", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("sizes", [(8,), (5, 8, 1), (3, 3, 3)])
def test_one_update_of_micro_batches_is_numpys_step_on_their_rows(kind, sizes):
    """`sizes`: the real rows of each batch of one update, padded to 8 (4 replicas of 2 rows): a
    batch of 1 row leaves 3 replicas without any; batches of one shape are scanned, others unrolled."""
    engine = _strategy(kind).extended
    rng = np.random.default_rng(sum(sizes))
    w, b = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)
    params = {"trainable": {"w": w, "b": b}, "non_trainable": {}}
    layout = state_layout(engine, engine.sharding, optax.sgd(LR), params, _PATHS)
    assert (layout.plan is None) == (kind == "replicated")
    tracker, metrics = Mean(), MetricCollection({})
    step = make_gradient_step(layout.on_stored(_apply), _loss, tracker, metrics, engine.num_replicas)
    xs = [rng.normal(size=(n, 5)).astype(np.float32) for n in sizes]
    ys = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    batches = [_placed(engine, x, y, 8) for x, y in zip(xs, ys)]
    feed = tuple(zip(*batches))
    stacked = len(sizes) > 1 and len(set(sizes)) == 1
    program = make_program(step, layout, engine, ("stacked" if stacked else "placed", 1, len(sizes)))
    placed = layout.params(params)
    metric_state = engine.per_replica_copies({"loss": tracker.init()})
    new, _, logs = program(placed, layout.init_opt_state(placed), metric_state, feed)
    got = layout.unpadded_params(new)["trainable"]
    want_w, want_b = _numpy_step(w, b, xs, ys)
    np.testing.assert_allclose(np.asarray(got["w"]), want_w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got["b"]), want_b, rtol=2e-5, atol=2e-6)
    x, y = np.concatenate(xs), np.concatenate(ys)
    want_loss = np.mean(np.sum((x @ w + b - y) ** 2, axis=-1))  # the running loss over the update's real rows
    got_loss = tracker.compute(jax.tree.map(lambda v: np.asarray(v).sum(0), logs["loss"]))
    np.testing.assert_allclose(float(got_loss), want_loss, rtol=2e-5)
    if kind == "zero3":
        assert layout.gradient_kinds["w"] != "replicated"  # each replica gets its share of w's gradient


def test_runs_group_updates_that_one_program_takes_together():
    class Batch:  # a placed batch: what `runs` reads of it
        def __init__(self, shape):
            self.signature = shape

    class Update:
        def __init__(self, *shapes):
            self.batches = [Batch(s) for s in shapes]

    updates = [Update(8, 8), Update(8, 8), Update(8, 5), Update(5, 5), Update(8, 8)]
    got = [(None if key is None else key[0], len(run)) for key, run in runs(updates)]
    assert got == [("placed", 2), (None, 1), ("placed", 1), ("placed", 1)]


def test_the_step_counters_move_by_the_updates_taken():
    state = TrainState(params={}, opt_state=(), metric_state=None, epoch=1, step=4, global_step=9, seed=0, callbacks={})
    after = state.stepped(3, {"trainable": []}, ("o",), {"loss": 1})
    assert (after.epoch, after.step, after.global_step) == (1, 7, 12)
    assert (after.params, after.opt_state, after.metric_state) == ({"trainable": []}, ("o",), {"loss": 1})
    assert (state.step, state.global_step) == (4, 9)  # unchanged: a new state


@pytest.mark.parametrize("kind", ["replicated", "zero3"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_runner_takes_an_execution_of_resident_and_placed_batches_as_numpy_steps(kind, accumulation):
    """`StepRunner.run` on one execution whose updates come from a resident pass and a placed one
    (two programs, one call each): the weights of NumPy's SGD steps on the same rows, in order.
    11 rows in batches of 4 (4, 4, 3) on 4 replicas, then a batch of 1 row (3 replicas without rows)."""
    engine = _strategy(kind).extended
    rng = np.random.default_rng(7)
    w, b = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)
    x, y = rng.normal(size=(11, 5)).astype(np.float32), rng.normal(size=(11, 3)).astype(np.float32)
    x1, y1 = rng.normal(size=(1, 5)).astype(np.float32), rng.normal(size=(1, 3)).astype(np.float32)
    params = {"trainable": {"w": w, "b": b}, "non_trainable": {}}
    layout = state_layout(engine, engine.sharding, optax.sgd(LR), params, _PATHS)
    tracker, metrics = Mean(), MetricCollection({})
    steps = {"gradient": make_gradient_step(layout.on_stored(_apply), _loss, tracker, metrics, engine.num_replicas)}
    runner = StepRunner(engine, steps, layout)
    resident = list(ls.data.batches((x, y), 4).resident_pass(engine, 0))
    placed = list(ls.data.batches((x1, y1), 4).distributed(engine, 0, fixed_padding=True))
    updates = list(accumulation_groups([*resident, *placed], accumulation))
    placed_params = layout.params(params)
    state = TrainState(params=placed_params, opt_state=layout.init_opt_state(placed_params),
                       metric_state=engine.per_replica_copies({"loss": tracker.init()}), epoch=0, step=0,
                       global_step=0, seed=0, callbacks={})
    state = runner.run(state, updates)
    rows = [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:]), (x1, y1)]
    for i in range(0, len(rows), accumulation):
        group = rows[i:i + accumulation]
        w, b = _numpy_step(w, b, [r[0] for r in group], [r[1] for r in group])
    got = layout.unpadded_params(state.params)["trainable"]
    np.testing.assert_allclose(np.asarray(got["w"]), w, rtol=3e-5, atol=3e-6)
    np.testing.assert_allclose(np.asarray(got["b"]), b, rtol=3e-5, atol=3e-6)
    assert (state.step, state.global_step) == (len(updates), len(updates))
    jaxpr, executable, per_call = runner.compiled()
    # k = 1: the resident run of 3 updates, then the placed one; k = 2: one update of 2 resident
    # batches, then one of a resident and a placed batch (unrolled); each program called once
    assert per_call == {1: 3, 2: 1}[accumulation]
    assert executable.memory_analysis() is not None


def test_a_function_jitted_over_the_state_is_compiled_once_for_every_step():
    """The step count is a leaf of the state's pytree and the loop's record its static part, which
    a step leaves alone (flax's `TrainState`): jitting over states of several steps traces once."""
    traced = []

    @jax.jit
    def f(state):
        traced.append(1)
        return state.global_step + state.params["trainable"][0].sum()

    state = TrainState(params={"trainable": [np.ones(2, np.float32)]}, opt_state=(), metric_state=None, epoch=3,
                       step=1, global_step=5, seed=0, callbacks={"EarlyStopping.0": {"wait": 1}})
    for _ in range(3):
        assert float(f(state)) == state.global_step + 2
        state = state.stepped(1, state.params, (), None)
    assert len(traced) == 1
    assert (state.epoch, state.step, state.global_step) == (3, 4, 8)
    ended = state.replace(epoch=4, step=0)  # an epoch's end: a new loop record, the count goes on
    assert (ended.epoch, ended.step, ended.global_step, ended.loop.epoch_start) == (4, 0, 8, 8)
    assert ended.callbacks == {"EarlyStopping.0": {"wait": 1}} and state.epoch == 3
    with pytest.raises(TypeError, match="no field"):
        state.replace(epochs=1)


@pytest.mark.parametrize("strategy", [lambda: ls.MirroredStrategy(1), lambda: ls.MirroredStrategy(3),
                                      lambda: ls.ShardedStrategy(mesh=ls.DeviceMesh((2, 4), ("batch", "model")),
                                                                 layout_map={".*dense.*/kernel": (None, "model")},
                                                                 batch_dim_name="batch", zero_stage=3, min_shard_size=1)])
def test_a_step_takes_over_the_states_buffers_and_nothing_handed_out_is_lost(strategy):
    """The training program donates the parameters' and optimizer state's buffers (one copy of the
    state on a device while a step runs, as Keras' own step): each step's input state is deleted,
    XLA aliases its outputs to it. What the trainer hands out stays whole: a `train_state`
    snapshot across a later fit, restored twice; weights a Keras callback read at every batch; the
    Keras model after fit. The arrays a restore gives are copied before a step takes them."""
    import keras

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(45, 5)).astype(np.float32), rng.normal(size=(45, 1)).astype(np.float32)
    with strategy().scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, name="dense_a"),
                                  keras.layers.Dense(1, name="dense_b")])
        model.compile(optimizer="adam", loss="mse")
    trainer = ls.Trainer(model)
    made = []

    class Reads(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            made.append((jax.tree.leaves(trainer._state.params), [w.copy() for w in self.model.get_weights()]))
    trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[Reads()])
    assert len(made) == 3 and all(a.is_deleted() for a in made[0][0] + made[1][0])  # taken by the next steps
    snapshot, weights = trainer.train_state, [np.array(w) for w in model.get_weights()]
    np.testing.assert_array_equal(weights[0], made[-1][1][0])
    trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert not any(a.is_deleted() for a in jax.tree.leaves((snapshot.params, snapshot.opt_state)))
    for _ in range(2):  # restored, trained on, restored again: the snapshot's arrays were not the step's to take
        trainer.restore(snapshot)
        np.testing.assert_array_equal(trainer.get_weights()[0], weights[0])
        trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    compiled = trainer._runner.compiled()[1].memory_analysis()
    state_bytes = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(
        (trainer._state.params, trainer._state.opt_state)))
    assert compiled.alias_size_in_bytes >= state_bytes - 64  # every state buffer reused (but scalars XLA may copy)


def test_a_state_is_copied_in_one_program_a_mesh_each_copy_laid_out_as_its_array(monkeypatch):
    """`own_copies` (what a background backup and a first step copy before the program takes the
    state over): every device array of a tree copied into buffers of its own, with its sharding and
    memory kind, values equal; one compiled program per mesh, not a dispatch per array; the leaves
    `pick` leaves out, and what is not a device array, as they are."""
    from lockstep.engine import own_copies

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    specs = [P(), P("data"), P("model"), P(None, "model"), P("data", "model"), P(("data", "model"))]
    tree = {"sharded": [jax.device_put(jnp.arange(64.0).reshape(8, 8) + i, NamedSharding(mesh, specs[i % 6]))
                        for i in range(30)],
            "host": jax.device_put(jnp.ones(3), NamedSharding(mesh, P(), memory_kind="pinned_host")),
            "one": jax.device_put(jnp.arange(5), jax.devices()[3]), "np": np.arange(2), "n": 7, "kept": jnp.zeros(2)}
    jitted, real_jit = [], jax.jit

    def counting_jit(*args, **kwargs):
        jitted.append(kwargs.get("out_shardings"))
        return real_jit(*args, **kwargs)
    monkeypatch.setattr(jax, "jit", counting_jit)
    out = own_copies(tree, lambda a: a is not tree["kept"])
    monkeypatch.undo()
    assert len(jitted) == 2  # the mesh's 31 arrays in one program, the single device's in another
    assert out["np"] is tree["np"] and out["n"] == 7 and out["kept"] is tree["kept"]
    for a, c in zip(jax.tree.leaves(tree["sharded"] + [tree["host"], tree["one"]]),
                    jax.tree.leaves(out["sharded"] + [out["host"], out["one"]])):
        assert c is not a and c.sharding == a.sharding and c.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(c), np.asarray(a))
        assert {s.data.unsafe_buffer_pointer() for s in c.addressable_shards}.isdisjoint(
            {s.data.unsafe_buffer_pointer() for s in a.addressable_shards})


def _device_0_bytes():
    """Bytes of the live arrays' buffers on device 0, each buffer once (garbage collected first)."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for a in jax.live_arrays():
        try:
            shards = [s for s in a.addressable_shards if s.device == jax.devices()[0]]
            for s in shards:
                if s.data.unsafe_buffer_pointer() not in seen:
                    seen.add(s.data.unsafe_buffer_pointer())
                    total += s.data.nbytes
        except jax.errors.JaxRuntimeError:  # deleted
            pass
    return total


def test_the_keras_variables_are_lent_the_state_and_a_device_holds_it_once(tmp_path):
    """In Keras' `fit` the model's and the optimizer's variables are the training state. lockstep's
    trainer holds the state and lends both kinds of Keras variables its arrays from the start of
    `fit` and after every step, so a device holds the weights and Adam's moments once: as many
    bytes on device 0 at every batch end as Keras' own `fit` holds on its one device (they held a
    second copy before), also after a `ModelCheckpoint` has saved them mid-fit (a save gave them
    copies, and lending stopped)."""
    import keras

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 64)).astype(np.float32), rng.integers(0, 10, 48)

    def run(strategy, trainer_of=None):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        held, same = [], []

        class Holds(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch % 3 == 2:  # (after a save; garbage collection is slow)
                    held.append(_device_0_bytes())
                if strategy:
                    state = self.model._trainer._state
                    ours = {id(a) for a in jax.tree.leaves((state.params, state.opt_state))}
                    same.append(all(id(v.value) in ours for v in [*model.weights, *model.optimizer.variables]))
        saves = keras.callbacks.ModelCheckpoint(os.path.join(tmp_path, f"{bool(strategy)}.weights.h5"),
                                                save_weights_only=True, save_freq=2)  # a save reads them mid-fit
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[saves, Holds()])
        return held, same

    keras_held, _ = run(None)  # (its model gone before the next is made)
    held, same = run(ls.MirroredStrategy(3))
    assert all(same) and len(same) == 6 and len(held) == len(keras_held) == 2
    slack = x.nbytes + y.nbytes + 4096  # (the data placed whole, metric states)
    assert max(held) <= max(keras_held) + slack, (held, keras_held)


def test_a_state_made_from_the_model_is_taken_over_by_its_first_step_uncopied():
    """The optimizer state optax makes as `fit` begins is the trainer's alone: the first step takes
    its buffers over (deleted after it) instead of copying it first; a state given to `restore`,
    which its caller holds, is copied and stays whole."""
    import keras

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 4)).astype(np.float32), rng.normal(size=(20, 1)).astype(np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    trainer = ls.Trainer(model, optimizer="adam", loss="mse", strategy=ls.MirroredStrategy(2))
    given = []

    class Given(ls.callbacks.Callback):
        def on_train_begin(self, logs=None):
            given.append(jax.tree.leaves(self.trainer._state.opt_state))
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Given()])
    assert given[0] and all(a.is_deleted() for a in given[0])
    snapshot = trainer.train_state
    trainer.restore(snapshot)
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Given()])
    assert not any(a.is_deleted() for a in jax.tree.leaves(snapshot.opt_state))


def test_a_state_replaced_before_any_fit_is_freed():
    """What the trainer keeps of a state made from the model, for its first step to take over,
    does not keep that state alive once `restore` has replaced it."""
    import gc
    import weakref

    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    trainer = ls.Trainer(model, optimizer="adam", loss="mse", strategy=ls.MirroredStrategy(2))
    x = np.ones((6, 4), np.float32)
    trainer.predict(x, verbose=0)  # builds the state
    made = [weakref.ref(a) for a in jax.tree.leaves(trainer.current_state().opt_state)]
    other = ls.Trainer(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]), optimizer="adam", loss="mse",
                       strategy=ls.MirroredStrategy(2))
    other.fit(x, np.ones((6, 3), np.float32), epochs=1, verbose=0)
    trainer.restore(other.train_state)
    gc.collect()
    assert made and all(ref() is None for ref in made)


def test_a_padded_sharded_state_lent_once_is_not_cut_again_at_every_step():
    """A sharded state is lent to the Keras variables in a user's hooks only: a hook at the start of
    `fit` alone does not make every later step cut the padded variables again (a collective with
    several workers)."""
    import keras

    strategy = ls.ShardedStrategy(mesh=ls.DeviceMesh((2, 4), ("batch", "model")), layout_map={}, batch_dim_name="batch",
                                  zero_stage=3, min_shard_size=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(3)])
        model.compile(optimizer="adam", loss="mse")
    trainer = ls.Trainer(model)
    x, y = np.ones((40, 5), np.float32), np.ones((40, 3), np.float32)
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)  # built, compiled
    assert trainer._layout.plan is not None and any(v.padded for v in trainer._layout.plan.variables)
    cuts = []
    unpadded = trainer._layout.unpadded_params
    trainer._layout.unpadded_params = lambda params, cut=True: (cut and cuts.append(1)) or unpadded(params, cut)

    class Begins(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            pass
    trainer.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[Begins()])
    assert 0 < len(cuts) <= 4, len(cuts)  # the hook's lend, the end of fit's; not one a step (10 steps)
