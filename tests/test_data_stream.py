"""`DataStream` on its own: the batches of each epoch (resident or placed), the position a backup
stores and a resume from it, passes that end inside an epoch, and data that runs out or changed.

Every batch is checked against NumPy: its real rows are the rows of the pass's order (the seed's
permutation of that pass), in order, whatever the number of replicas (a replica may get no row).
"""

import threading
import warnings

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lockstep as ls
from lockstep.data import IterableBatches, batches
from lockstep.engine import Engine, ResidentBatch, take_step
from lockstep.training import DataPosition
from lockstep.data import DataStream


def _rows(batch):
    """The real rows of a distributed or resident batch, in order, on the host."""
    placed = batch.placed() if isinstance(batch, ResidentBatch) else batch
    data, mask = np.asarray(placed.data), np.asarray(placed.mask)
    assert mask.sum() == batch.num_real
    return data[mask > 0]


def _expected(x, batch_size, order):
    return [x[order[i:i + batch_size]] for i in range(0, len(order), batch_size)]


def _data(n):
    return np.arange(n * 2, dtype=np.float32).reshape(n, 2)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 23), batch_size=st.integers(1, 9), replicas=st.sampled_from([1, 2, 3, 8]),
       resident=st.booleans())
def test_each_epoch_gives_the_rows_of_its_pass_in_order(n, batch_size, replicas, resident):
    x = _data(n)
    engine = Engine(jax.devices()[:replicas])
    train = batches(x, batch_size, shuffle=True, seed=5)
    stream = DataStream(engine, train, None, 1, resident=resident)
    for epoch in range(2):
        got = [_rows(b) for b in stream.epoch(epoch)]
        want = _expected(x, batch_size, train.order(epoch))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    assert stream.samples == 2 * n


@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 19), batch_size=st.integers(1, 5), replicas=st.sampled_from([1, 2, 4]),
       taken=st.integers(1, 6), resident=st.booleans())
def test_a_resume_from_the_position_gives_the_remaining_batches(n, batch_size, replicas, taken, resident):
    x = _data(n)
    engine = Engine(jax.devices()[:replicas])
    train = batches(x, batch_size, shuffle=True, seed=1)
    total = -(-n // batch_size)
    taken = min(taken, total)
    first = DataStream(engine, train, None, 1, resident=resident)
    epoch = first.epoch(0)
    for _ in range(taken):
        next(epoch)
    position = first.position()
    assert (position.pass_index, position.offset) == (0, taken)
    assert position.fingerprint is not None
    again = DataStream(engine, batches(x, batch_size, shuffle=True, seed=1), None, 1, resident=resident)
    again.start(DataPosition.from_json(position.to_json()))
    rest = [_rows(b) for b in again.epoch(0, done=taken)]
    want = _expected(x, batch_size, train.order(0))[taken:]
    assert len(rest) == len(want)
    for a, b in zip(rest, want):
        np.testing.assert_array_equal(a, b)


def test_a_resume_on_changed_data_is_refused():
    engine = Engine(jax.devices()[:2])
    x = _data(10)
    first = DataStream(engine, batches(x, 3, shuffle=True, seed=1), None, 1)
    epoch = first.epoch(0)
    next(epoch), next(epoch)
    position = first.position()
    changed = DataStream(engine, batches(x + 1, 3, shuffle=True, seed=1), None, 1)
    changed.start(position)
    with pytest.raises(ValueError, match="cannot resume: the training data differs"):
        next(changed.epoch(0, done=2))


def test_steps_per_epoch_ends_an_epoch_with_its_pass_as_keras_does():
    engine = Engine(jax.devices()[:4])
    x = _data(7)
    train = batches(x, 3, shuffle=True, seed=2)  # passes of 3 batches (3, 3, 1 rows)
    stream = DataStream(engine, train, 2, 1)
    want = _expected(x, 3, train.order(0)) + _expected(x, 3, train.order(1))[:2]
    got = [_rows(b) for b in stream.epoch(0)]
    with pytest.warns(UserWarning, match=r"ended after 1 of `steps_per_epoch=2` steps in epoch 2: the epoch ends"):
        got += [_rows(b) for b in stream.epoch(1)]
    assert len(got) == 3 and (stream.position().pass_index, stream.position().offset) == (0, 3)  # the pass's end
    got += [_rows(b) for b in stream.epoch(2)]  # a new pass
    assert len(got) == 5
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert (stream.position().pass_index, stream.position().offset) == (1, 2)


class _Hooked(IterableBatches):
    """Batches that record where the loops reading them say an epoch begins and ends."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def loop_begins(self):
        self.seen.append("begin")

    def loop_ended(self):
        self.seen.append("end")

    def host_pass(self, epoch, start=0, state=None):
        for i, batch in enumerate(super().host_pass(epoch, start, state), start=start):
            self.seen.append(i)
            yield batch


@pytest.mark.filterwarnings("ignore:a pass over the training data ended")
def test_each_epoch_of_the_stream_and_each_custom_loop_pass_is_begun_and_ended_on_the_data():
    """Epochs of `steps_per_epoch` begin and end in the middle of a pass (a PyDataset's hooks, as
    Keras calls them); an epoch left unfinished (a callback stopped `fit`) is not ended; a custom
    loop over a distributed dataset begins and ends each pass."""
    seen = []
    data = _Hooked([(_data(2), np.zeros(2))] * 3, seen)
    stream = DataStream(Engine(jax.devices()[:2]), data, 2, 1)
    for epoch in range(3):
        list(stream.epoch(epoch))
        stream.ended()
    next(stream.epoch(3))
    assert seen == ["begin", 0, 1, "end", "begin", 2, "end", "begin", 0, 1, "end", "begin", 2]
    seen.clear()
    distributed = ls.MirroredStrategy(2).experimental_distribute_dataset(_Hooked([_data(2)] * 2, seen))
    assert [len(list(distributed)) for _ in range(2)] == [2, 2]
    assert seen == ["begin", 0, 1, "end"] * 2


@pytest.mark.filterwarnings("ignore:a pass over the training data ended")
@pytest.mark.parametrize("k", [1, 2])
def test_a_resume_at_the_end_of_an_epoch_that_ended_with_its_pass_goes_on_as_the_run_did(k):
    """7 batches a pass, epochs of 3 updates of k batches: with k=1 epochs of 3, 3, 1 batches, with
    k=2 of 6, 1 (a short group). A backup at the last update of the epoch that ended with its pass
    holds the pass's end: the resumed stream ends that epoch there and starts the next pass in the
    next epoch, as the run did (it read the next pass into that epoch when the position had moved
    on at once)."""
    engine = Engine(jax.devices()[:2])
    x = _data(7)
    make = lambda: batches(x, 1, shuffle=True, seed=4)  # noqa: E731 - 7 batches of one row
    run = DataStream(engine, make(), 3, k)
    last = 2 if k == 1 else 1  # the epoch that ends with its pass
    assert [len(list(run.epoch(e))) for e in range(last + 1)] == ([3, 3, 1] if k == 1 else [6, 1])
    at = run.position()  # a backup at that epoch's last update
    assert (at.pass_index, at.offset) == (0, 7)
    want = [_rows(b) for b in run.epoch(last + 1)]
    resumed = DataStream(engine, make(), 3, k)
    resumed.start(DataPosition.from_json(at.to_json()))
    assert list(resumed.epoch(last, done=1)) == []
    got = [_rows(b) for b in resumed.epoch(last + 1)]
    assert len(got) == len(want) == 3 * k
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_one_shot_iterator_that_runs_out_is_an_error():
    engine = Engine(jax.devices()[:2])
    one_shot = IterableBatches(iter([_data(4), _data(4)]))
    stream = DataStream(engine, one_shot, 3, 1)
    with pytest.raises(ValueError, match="ran out after 2 of `steps_per_epoch=3` steps"):
        list(stream.epoch(0))


def test_resident_and_placed_batches_are_alike():
    """A resident pass's batch, placed from the host, is the batch the placed pass gives."""
    engine = Engine(jax.devices()[:8])
    x = _data(13)
    train = batches(x, 5, shuffle=True, seed=3)
    resident = list(DataStream(engine, train, None, 1, resident=True).epoch(0))
    placed = list(DataStream(engine, train, None, 1, resident=False).epoch(0))
    assert all(isinstance(b, ResidentBatch) for b in resident)
    for r, p in zip(resident, placed):
        assert r.step.counts.tolist() == p.step.counts.tolist()
        with warnings.catch_warnings():
            np.testing.assert_array_equal(np.asarray(r.placed().data), np.asarray(p.data))
            np.testing.assert_array_equal(np.asarray(r.placed().mask), np.asarray(p.mask))
        assert r.digest() == p.digest()


@pytest.mark.parametrize("replicas", [1, 3, 8])
def test_a_compiled_step_takes_each_resident_batch_as_placing_it_gives_it(replicas):
    """Inside the replicas' program `take_step` gives a resident batch's rows, mask and count as
    placing the batch from the host does: one replica indexes the data placed once (the pass's
    `table`), several each hold their rows of the pass (13 rows in batches of 5, shuffled: the last
    batch of 3 leaves replicas without rows)."""
    engine = Engine(jax.devices()[:replicas])
    x = _data(13)
    one_pass = list(batches(x, 5, shuffle=True, seed=3).resident_pass(engine, 1))
    whole = one_pass[0].pass_
    assert (whole.table is not None) == (replicas == 1)
    taken = jax.jit(engine.mapped(
        lambda source, i: take_step(whole.treedef, *source, i, whole.per_replica, engine.batch_axis),
        (("rows", "replicated", "replicated"), "replicated"), ("per_replica", "per_replica", "replicated"), with_batch=False))
    for batch in one_pass:
        rows, mask, count = taken((whole.leaves, whole.counts, whole.table), np.int32(batch.index))
        placed = batch.placed()
        np.testing.assert_array_equal(np.asarray(rows).reshape(-1, 2), np.asarray(placed.data))
        np.testing.assert_array_equal(np.asarray(mask).reshape(-1), np.asarray(placed.mask))
        assert float(count) == batch.num_real


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("replicas", [1, 3])
def test_the_next_pass_is_placed_ahead_once_and_taken(monkeypatch, shuffle, replicas):
    """`fit`'s stream asks for the next pass ahead: it is placed once (in the background), taken by
    the next epoch, and holds that epoch's rows; without shuffling every pass is the same one,
    placed once for the whole fit; the last epoch places nothing after it."""
    x = _data(11)
    engine = Engine(jax.devices()[:replicas])
    train = batches(x, 4, shuffle=shuffle, seed=3)
    placed = []
    place = type(train)._place_pass
    monkeypatch.setattr(train, "_place_pass", lambda e, epoch, start, *order: placed.append(
        (epoch, threading.current_thread().name.startswith("lockstep-next-pass"))) or place(train, e, epoch, start, *order))
    stream = DataStream(engine, train, None, 1, epochs=3)
    for epoch in range(3):
        got = [_rows(b) for b in stream.epoch(epoch)]
        want = _expected(x, 4, train.order(epoch))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    assert placed == ([(0, False), (1, True), (2, True)] if shuffle else [(0, False)])
    assert train._next_pass is None or not shuffle


@pytest.mark.parametrize("draw_between", [False, True])
def test_passes_drawn_from_numpys_global_state_are_keras_permutations_placed_ahead_when_still_so(
        monkeypatch, draw_between):
    """`seed=None`: each pass's order is `np.random.permutation` drawn as the pass begins (NumPy's
    global state, as Keras' fit draws it). The next pass is placed ahead in the order a copy of the
    state gives; it is taken when the pass's own draw gives that order, and placed again when
    something drew from NumPy's global state in between."""
    x = _data(11)
    engine = Engine(jax.devices()[:3])
    train = batches(x, 4, shuffle=True, seed=None)
    placed = []
    place = type(train)._place_pass
    monkeypatch.setattr(train, "_place_pass", lambda e, epoch, start, *order: placed.append(
        (epoch, threading.current_thread().name.startswith("lockstep-next-pass"))) or place(train, e, epoch, start, *order))
    stream = DataStream(engine, train, None, 1, epochs=3)
    np.random.seed(7)
    want_orders = []
    for epoch in range(3):
        state = np.random.get_state()
        got = [_rows(b) for b in stream.epoch(epoch)]
        reference = np.random.RandomState()
        reference.set_state(state)
        want_orders.append(reference.permutation(11))
        for a, b in zip(got, _expected(x, 4, want_orders[-1]), strict=True):
            np.testing.assert_array_equal(a, b)
        if draw_between:
            np.random.uniform(size=7)
    # the main thread places pass 0, and passes 1 and 2 again where NumPy was drawn from in between
    # (their placing ahead, cancelled then, may or may not have begun)
    assert [p for p, ahead in placed if not ahead] == ([0, 1, 2] if draw_between else [0])
    if not draw_between:
        assert placed == [(0, False), (1, True), (2, True)]
    assert len({tuple(o) for o in want_orders}) == 3


def test_a_later_fit_on_the_same_batches_draws_its_passes_from_numpys_global_state_anew():
    """Keras draws every pass: the same `batches(seed=None)` given to a second fit (a new stream,
    the first closed) draws pass 0 again, the next permutation, not the first fit's."""
    x = _data(9)
    engine = Engine(jax.devices()[:2])
    train = batches(x, 4, shuffle=True, seed=None)
    np.random.seed(3)
    want = [np.random.permutation(9) for _ in range(2)]
    np.random.seed(3)
    for fit in range(2):
        stream = DataStream(engine, train, None, 1, epochs=1)
        got = [_rows(b) for b in stream.epoch(0)]
        stream.close()
        for a, b in zip(got, _expected(x, 4, want[fit]), strict=True):
            np.testing.assert_array_equal(a, b)


def test_arrays_changed_during_fit_give_one_replica_the_rows_they_give_several():
    """A callback that changes the arrays in place during `fit` (which `Batches` asks users not to
    do) changes nothing that one replica trains on, as with several replicas: one replica's pass
    indexes a copy of the arrays (the CPU's devices would read the caller's own memory)."""
    import lockstep as ls

    def losses(replicas):
        x, y = np.ones((64, 32), np.float32), np.zeros((64, 1), np.float32)

        class Change(ls.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                x[:] = 3.0
        trainer = ls.Trainer(ls.FunctionalModel(lambda rng, x: {"w": np.full((32, 1), 0.01, np.float32)},
                                                lambda p, x, training=False: x @ p["w"]),
                             optimizer="sgd", loss="mse", strategy=ls.MirroredStrategy(replicas))
        return trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[Change()]).history["loss"]
    np.testing.assert_allclose(losses(1), losses(2), rtol=1e-6)


@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_lets_go_of_a_pass_placed_ahead_and_a_later_fit_reads_the_arrays_again(replicas):
    """With `steps_per_epoch` a pass is always placed ahead; when `fit` ends it is dropped (and, with
    one replica, the arrays placed whole that passes index), so data changed between two fits is
    what the second trains on."""
    import lockstep as ls

    x = np.ones((16, 2), np.float32)
    y = np.zeros((16, 1), np.float32)
    data = batches((x, y), 4)
    trainer = ls.Trainer(ls.FunctionalModel(lambda rng, x: {"w": np.zeros((2, 1), np.float32)},
                                            lambda p, x, training=False: x @ p["w"]),
                         optimizer="sgd", loss="mse", strategy=ls.MirroredStrategy(replicas))
    trainer.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    assert data._next_pass is None and data._whole is None
    before = np.asarray(trainer.get_weights()["w"])
    x[:] = 2.0  # the caller's arrays, changed between fits
    seen = []

    class Loss(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(float(logs["loss"]))
    trainer.fit(data, epochs=1, steps_per_epoch=1, verbose=0, callbacks=[Loss()])
    assert data._next_pass is None
    np.testing.assert_allclose(seen, [np.mean((x[:4] @ before) ** 2)], rtol=1e-6)  # the new rows, not the old
