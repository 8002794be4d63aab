"""`steps_per_execution=k`: k optimizer steps in one compiled call, each exactly the step taken
alone. References are independent of the new path: the same fit with one step a call and its
batches placed from the host (in-memory data kept on the devices turned off), and Keras' own
one-device `fit`."""


import jax
import keras
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lockstep as ls

from common import data, keras_mlp  # noqa: E402
from common import model as mlp  # noqa: E402
from keras_reference import assert_equals_one_device, assert_logs_close, assert_weights_close, keras_fit  # noqa: E402
from launching import StopAt, Stopped  # noqa: E402
from suite import FULL, variants  # noqa: E402


class BatchLogs(ls.callbacks.Callback):
    """Every call's (epoch, first step, last step) and the logs after it."""

    def __init__(self):
        super().__init__()
        self.calls, self.logs = [], {}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.first = batch

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append((self.epoch, self.first, batch))
        self.logs[(self.epoch, batch)] = dict(logs)


def _fit(x, y, replicas, k, accumulation=1, batch=8, epochs=2, placed=False, data_arg=None):
    with pytest.MonkeyPatch.context() as patch:
        if placed:  # the reference: every batch placed from the host (one step a call)
            patch.setattr("lockstep.engine._resident.RESIDENT_LIMIT_MB", 0)
        trainer = ls.Trainer(mlp(), optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy_from_logits",
                             metrics=["accuracy"], strategy=ls.MirroredStrategy(replicas),
                             gradient_accumulation_steps=accumulation, steps_per_execution=k)
        logs = BatchLogs()
        if data_arg is not None:
            history = trainer.fit(data_arg, epochs=epochs, verbose=0, callbacks=[logs])
        else:
            history = trainer.fit(x, y, batch_size=batch, epochs=epochs, shuffle=True, seed=5, verbose=0,
                                  callbacks=[logs])
    return trainer.get_weights(), history.history, logs


def _assert_same_steps(got, want, k, atol=1e-6):
    """`got` (k steps a call) has `want`'s weights and epoch logs, and each call's logs are `want`'s
    at that call's last step; calls cover the steps k at a time, as Keras calls them."""
    assert_weights_close(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), atol=atol)
    assert_logs_close(got[1], want[1], rtol=1e-6, atol=atol)
    for (epoch, first, last) in got[2].calls:
        assert last - first + 1 <= k
        assert_logs_close(got[2].logs[(epoch, last)], want[2].logs[(epoch, last)], rtol=1e-6, atol=atol)
    per_epoch = {}
    for epoch, first, last in got[2].calls:
        assert first == per_epoch.get(epoch, 0)
        per_epoch[epoch] = last + 1
    assert per_epoch == {e: max(s for (ep, s) in want[2].logs if ep == e) + 1 for e in per_epoch}


@settings(max_examples=8 if FULL else 1, deadline=None)
@example(n=37, batch=8, replicas=4, k=8, accumulation=1)  # the last batch of 5 rows leaves replicas of 4 empty
@example(n=37, batch=8, replicas=4, k=3, accumulation=2)
@given(n=st.integers(1, 41), batch=st.integers(1, 12), replicas=st.sampled_from([1, 2, 3, 4, 8]),
       k=st.integers(1, 8), accumulation=st.integers(1, 3))
def test_k_steps_a_call_equal_one_step_a_call_placed_from_the_host(n, batch, replicas, k, accumulation):
    """Any dataset size (N = 1, primes, a last batch shorter than the replicas, replicas without
    rows), batch, replica count and accumulation; and equal to one device."""
    x, y = data(n, seed=n)
    want = _fit(x, y, replicas, 1, accumulation, batch, placed=True)
    got = _fit(x, y, replicas, k, accumulation, batch)
    _assert_same_steps(got, want, k)
    one_device = _fit(x, y, 1, 1, accumulation, batch, placed=True)
    assert_equals_one_device(got[:2], one_device[:2], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("k", [3, 8])
def test_batches_of_an_iterable_with_a_short_last_one_run_k_a_call(k):
    """Data that is not in memory (a list of batches, the last of 5 rows on 4 replicas) is placed
    batch by batch and its steps still run k a call."""
    x, y = data(37, seed=1)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 37, 8)]
    want = _fit(None, None, 4, 1, data_arg=batches)
    got = _fit(None, None, 4, k, data_arg=batches)
    _assert_same_steps(got, want, k)


def _keras_fit(strategy, x, y, k, dropout=0.0):
    """Keras code as written, compiled with `steps_per_execution` (lockstep runs it in `strategy`'s
    scope; with no strategy, Keras' own one-device fit)."""
    return keras_fit(lambda: keras_mlp(batch_norm=True, dropout=dropout), x, y, strategy, batch_size=16, epochs=2,
                     validation_split=0.25, compile=lambda: dict(
                         optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                         metrics=["accuracy"], steps_per_execution=k))


@pytest.mark.parametrize("k", variants([1, 4], {4}))
def test_keras_compile_steps_per_execution_equals_keras_own_fit(k):
    """BatchNorm over the global batch; 50 rows: 37 to train in batches of 16 (the last, 5 rows,
    leaves a replica of 4 empty), 13 to validate."""
    x, y = data(50, seed=3)
    got = _keras_fit(ls.MirroredStrategy(4), x, y, k)
    assert_equals_one_device(got, _keras_fit(None, x, y, k), rtol=2e-5, atol=1e-5)


def test_keras_dropout_and_batchnorm_k_a_call_equal_one_a_call_bit_for_bit():
    x, y = data(50, seed=4)
    want = _keras_fit(ls.MirroredStrategy(4), x, y, 1, dropout=0.3)
    got = _keras_fit(ls.MirroredStrategy(4), x, y, 5, dropout=0.3)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("accumulation", variants([1, 2], {2}))
def test_a_run_k_a_call_resumes_from_its_backup_and_equals_the_uninterrupted_one(tmp_path, accumulation):
    """Backups every 2 steps with 3 steps a call land at the end of the calls that reach a multiple
    of 2: 6 steps an epoch (steps 3 and 6 backed up), stopped in the call ending at step 9; with
    accumulation 2, 3 steps an epoch (step 3 backed up), stopped at step 6. The resumed run equals
    one step a call, uninterrupted."""
    x, y = data(45, seed=2)  # 6 batches of 8 an epoch

    def trainer(k):
        return ls.Trainer(mlp(), optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy_from_logits",
                          metrics=["accuracy"], strategy=ls.MirroredStrategy(4),
                          gradient_accumulation_steps=accumulation, steps_per_execution=k)

    def fit(t, *callbacks):
        return t.fit(x, y, batch_size=8, epochs=3, shuffle=True, seed=1, verbose=0, callbacks=list(callbacks))

    uninterrupted = trainer(1)
    want = fit(uninterrupted).history
    first = trainer(3)
    with pytest.raises(Stopped):
        fit(first, ls.callbacks.BackupAndRestore(tmp_path, save_freq=2), StopAt(7 if accumulation == 1 else 5))
    resumed = trainer(3)
    backup = ls.callbacks.BackupAndRestore(tmp_path, save_freq=2)
    got = fit(resumed, backup).history
    assert backup.restored_from == (6 if accumulation == 1 else 3)
    assert_logs_close(got, want, rtol=1e-6, atol=1e-6)
    assert_weights_close(jax.tree.leaves(resumed.get_weights()), jax.tree.leaves(uninterrupted.get_weights()))


def test_callbacks_see_calls_as_keras_calls_them_and_count_steps(tmp_path):
    """5 steps an epoch, 3 a call: batch hooks at steps (0, 2) and (3, 4), as Keras'; a checkpoint
    every 2 steps saves at the end of the calls that reach steps 2, 4, 6 and 8, and 10."""
    x, y = data(37, seed=6)
    logs = BatchLogs()
    trainer = ls.Trainer(mlp(), loss="sparse_categorical_crossentropy_from_logits", strategy=ls.MirroredStrategy(4),
                         steps_per_execution=3)
    checkpoint = ls.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch}-{loss:.9f}.npz"), save_freq=2,
                                              save_weights_only=True)
    trainer.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[logs, checkpoint])
    assert logs.calls == [(0, 0, 2), (0, 3, 4), (1, 0, 2), (1, 3, 4)]
    saved = sorted(p.name.split("-")[1] for p in tmp_path.iterdir())
    assert saved == ["1", "1", "2", "2"]  # calls ending at global steps 3 and 5, then 8 and 10


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "auto", None])
def test_steps_per_execution_must_be_a_positive_integer(bad):
    if bad is None:  # None: the default (1, or a compiled Keras model's)
        assert ls.Trainer(mlp(), steps_per_execution=None).steps_per_execution == 1
        return
    with pytest.raises(ValueError, match=r"`steps_per_execution` must be a positive integer, got steps_per_execution="):
        ls.Trainer(mlp(), steps_per_execution=bad)


@pytest.mark.parametrize("k", [1, 4])
def test_steps_in_flight_stay_bounded_for_a_keras_model_without_non_trainable_state(k):
    """The token that bounds the programs in flight is the first array of a step's outputs; a
    Keras model's parameters start with its (empty) non-trainable list, which once hid every token,
    so nothing was bounded and 4 CPU devices deadlocked after a few hundred small steps."""
    x, y = data(400, seed=8)
    strategy = ls.MirroredStrategy(4)
    with strategy.scope():
        model = keras_mlp(softmax=False)
    seen = []

    class InFlight(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(strategy.extended.steps_in_flight)

    ls.Trainer(model, loss="sparse_categorical_crossentropy_from_logits", steps_per_execution=k).fit(
        x, y, batch_size=8, epochs=1, verbose=0, callbacks=[InFlight()])
    assert 1 <= max(seen) <= 8


def test_the_steps_in_flight_keep_no_old_parameters_alive():
    """The token of a step in flight is a small output (its metric count), and a finished step's
    is let go: a device holds its parameters' current copies only (the training state's and the
    Keras model's own), not one more per step dispatched (measured: 3 more copies of the first
    kernel, up to 8)."""
    x, y = data(256, seed=3)
    strategy = ls.MirroredStrategy(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input(x.shape[1:]), keras.layers.Dense(37), keras.layers.Dense(10)])
    copies = []

    def copies_of_the_first_kernel():
        device, seen = strategy.devices[0], set()
        for a in jax.live_arrays():
            if a.shape == (x.shape[1], 37):
                seen |= {s.data.unsafe_buffer_pointer() for s in a.addressable_shards if s.device == device}
        return len(seen)

    class Count(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            jax.block_until_ready(self.trainer.train_state.params)
            copies.append(copies_of_the_first_kernel())

    ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits").fit(
        x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Count()])
    assert max(copies) <= 2, copies  # the state's and the Keras model's


def test_a_donating_programs_token_is_an_output_its_next_call_does_not_take_over():
    """A program that donates its state (the training step) is counted in flight by its last output
    (a metric count): its first, a parameter, is deleted by the next call, and the bound took a
    deleted token for a finished program (a Dropout's 8-byte seed state was the smaller end: 32
    programs in flight and gloo's collective time-out on 4 replicas)."""
    import collections

    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    strategy = ls.MirroredStrategy(2)
    whole = NamedSharding(strategy.mesh, P())
    step = strategy.extended.jit(lambda state, n: (state + 1, n + jnp.ones(4)), (whole, whole), donate_argnums=(0,))
    state, count = jax.device_put(jnp.zeros(1), whole), jax.device_put(jnp.zeros(4), whole)
    tokens = []

    class Recorded(collections.deque):
        def append(self, token):
            tokens.append(token)
            super().append(token)
    strategy.extended._compiler._in_flight._tokens = Recorded()
    for _ in range(3):
        state, count = step(state, count)
    assert len(tokens) == 3 and all(t.shape == (4,) for t in tokens)  # counts, never a state the next call deletes


def test_an_interrupt_after_a_step_took_over_the_state_leaves_the_trainer_its_result():
    """An execution of two runs (sequences of two lengths, `steps_per_execution=2`): the first run's
    program takes over the state; an interrupt in the second (Ctrl-C while it compiles) left the
    trainer the deleted arrays ("Array has been deleted" from fit's own clean-up). Now the trainer
    holds the first run's result: the model syncs, evaluates and trains on."""
    import lockstep.training._step_runner as runner_module

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, n, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))
               for n in (4, 4, 4, 6)]
    with ls.MirroredStrategy(2).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((None, 3)), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    made = runner_module.make_program

    def interrupted_once(step, layout, engine, key):
        call = made(step, layout, engine, key)

        def program(params, opt_state, metric_state, feed):
            if jax.tree.leaves(feed[0])[0].shape[1] == 6 and not seen:
                seen.append(1)
                raise KeyboardInterrupt("Ctrl-C while the second run's program compiles")
            return call(params, opt_state, metric_state, feed)
        program.prepare = call.prepare
        return program
    seen = []
    runner_module.make_program = interrupted_once
    try:
        with pytest.raises(KeyboardInterrupt):
            model.fit(batches, epochs=1, verbose=0)
    finally:
        runner_module.make_program = made
    assert seen and [w.shape for w in model.get_weights()] == [(3, 1), (1,)]
    assert np.isfinite(model.evaluate(batches[:1], verbose=0))
    model.fit(batches, epochs=1, verbose=0)
