"""Strategies, `run` / `reduce` / `gather`, the replica context: checked against NumPy."""

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lockstep as ls
from lockstep.engine._compiler import MAX_STEPS_IN_FLIGHT
from suite import variants

REPLICAS = [1, 2, 3, 4, 8]
SIZES = [1, 7, 63, 64, 65, 1003]


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)).astype(np.float32)


def per_sample(b):
    return b * 2.0


def replica_stats(b):
    ctx = ls.get_replica_context()
    m = ctx.mask[:, None] > 0
    local_sum = jnp.sum(jnp.where(m, b, 0.0), axis=0)
    count = jnp.sum(ctx.mask)
    local_mean = local_sum / count  # NaN on a replica holding only padding
    local_max = jnp.max(jnp.where(m, b, -jnp.inf), axis=0)
    local_min = jnp.min(jnp.where(m, b, jnp.inf), axis=0)
    return {
        "sum": local_sum, "mean": local_mean, "max": local_max, "min": local_min,
        "ctx_sum": ctx.all_reduce(ls.ReduceOp.SUM, local_sum),
        "ctx_mean": ctx.all_reduce(ls.ReduceOp.MEAN, local_mean),
        "ctx_max": ctx.all_reduce("max", local_max),
        "ctx_min": ctx.all_reduce("MIN", local_min),
        "ctx_gather": ctx.all_gather(b, axis=0),
        "ctx_gather_mask": ctx.all_gather(ctx.mask, axis=0),
        "id": ctx.replica_id_in_sync_group,
    }


@pytest.mark.parametrize("r", variants(REPLICAS, {3, 8}))  # make test-full: every count and size
@pytest.mark.parametrize("n", variants(SIZES, {1, 7, 65, 1003}))
@pytest.mark.parametrize("batch_size", [64, 3])
def test_reduce_gather_and_collectives_match_numpy(r, n, batch_size):
    if batch_size == 3 and n == 1003:
        n = 101  # keep the step count small; 101 is prime and leaves a short last batch
    s = ls.MirroredStrategy(r)
    x = _data(n)
    gathered = []
    for i, batch in enumerate(s.experimental_distribute_dataset(ls.data.batches(x, batch_size))):
        ref = x[i * batch_size:(i + 1) * batch_size]
        out = s.run(per_sample, args=(batch,))
        gathered.append(np.asarray(s.gather(out)))
        np.testing.assert_allclose(s.reduce("SUM", out, axis=0), 2 * ref.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s.reduce("MEAN", out, axis=0), 2 * ref.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(s.reduce("MAX", out, axis=0), 2 * ref.max(0))
        np.testing.assert_array_equal(s.reduce("MIN", out, axis=0), 2 * ref.min(0))

        st = s.run(replica_stats, args=(batch,))
        np.testing.assert_allclose(s.reduce("SUM", st["sum"]), ref.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s.reduce("MEAN", st["mean"]), ref.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(s.reduce("MAX", st["max"]), ref.max(0))
        np.testing.assert_array_equal(s.reduce("MIN", st["min"]), ref.min(0))
        for key, want in [("ctx_sum", ref.sum(0)), ("ctx_mean", ref.mean(0))]:
            assert isinstance(st[key], ls.Mirrored)
            np.testing.assert_allclose(np.asarray(st[key]), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(st["ctx_max"]), ref.max(0))
        np.testing.assert_array_equal(np.asarray(st["ctx_min"]), ref.min(0))
        # all_gather keeps static shapes (padding included); the gathered mask picks the real rows
        for g, gm in zip(s.experimental_local_results(st["ctx_gather"]),
                         s.experimental_local_results(st["ctx_gather_mask"])):
            np.testing.assert_array_equal(np.asarray(g)[np.asarray(gm) > 0], ref)
        ids = [int(v) for v in s.experimental_local_results(st["id"])]
        assert ids == list(range(r))
    np.testing.assert_array_equal(np.concatenate(gathered), 2 * x)


def test_a_replica_with_no_data_contributes_nothing():
    s = ls.MirroredStrategy(8)
    x = np.arange(3, dtype=np.float32)[:, None]  # 3 samples, 8 replicas: 5 replicas hold padding only
    batch = next(iter(s.experimental_distribute_dataset([x])))
    assert batch.num_real == 3
    st = s.run(replica_stats, args=(batch,))
    means = [np.asarray(v) for v in s.experimental_local_results(st["mean"])]
    assert np.isnan(means[-1]).all()  # a naive average would be NaN
    np.testing.assert_allclose(s.reduce("MEAN", st["mean"]), [1.0])
    np.testing.assert_allclose(np.asarray(st["ctx_mean"]), [1.0])


def linear_step(w, batch):
    x, y = batch

    def loss_fn(w):
        return ls.compute_average_loss((x @ w - y) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(w)
    return loss, grad


@pytest.mark.parametrize("r", REPLICAS)
@pytest.mark.parametrize("n", [1, 7, 65, 1003])
def test_compute_average_loss_gives_single_device_loss_and_gradient(r, n):
    s = ls.MirroredStrategy(r)
    x = _data(n)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1).astype(np.float32)
    w = np.array([0.3, 0.1, -0.2], np.float32)
    for i, batch in enumerate(s.experimental_distribute_dataset(ls.data.batches((x, y), 64))):
        xb, yb = x[i * 64:(i + 1) * 64], y[i * 64:(i + 1) * 64]
        loss, grad = s.run(linear_step, args=(w, batch))
        resid = xb @ w - yb
        np.testing.assert_allclose(s.reduce("SUM", loss), np.mean(resid ** 2), rtol=1e-5)
        assert isinstance(grad, ls.Mirrored)  # JAX sums gradients of replicated values over replicas
        np.testing.assert_allclose(np.asarray(grad), 2 * xb.T @ resid / len(xb), rtol=1e-4, atol=1e-6)


def test_arguments_holding_lists_and_tuples_of_arrays(r=4):
    """Parameters as a list (Keras' `trainable_variables` order) or a tuple, mixed with dicts."""
    s = ls.MirroredStrategy(r)
    x = _data(13)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
    params = {"layers": [np.array([0.3, 0.1, -0.2], np.float32), np.float32(0.5)], "scale": (np.float32(2.0),)}

    def step(p, batch):
        def loss_fn(p):
            w, b = p["layers"]
            return ls.compute_average_loss((p["scale"][0] * (batch[0] @ w + b) - batch[1]) ** 2)
        return jax.grad(loss_fn)(p)

    batch = next(iter(s.experimental_distribute_dataset(ls.data.batches((x, y), 13))))
    grad = s.run(step, args=(params, batch))
    resid = 2.0 * (x @ params["layers"][0] + 0.5) - y
    np.testing.assert_allclose(np.asarray(grad["layers"][0]), 2 * 2.0 * x.T @ resid / 13, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(grad["layers"][1]), 2 * 2.0 * resid.mean(), rtol=1e-4)


def test_loops_whose_carry_starts_replicated_and_becomes_per_replica():
    s = ls.MirroredStrategy(4)
    x = _data(13)
    batch = next(iter(s.experimental_distribute_dataset(ls.data.batches(x, 13))))

    def step(w, b):
        real = b[:, 0] * ls.get_replica_context().mask  # 13 rows on 4 replicas: padding rows count 0
        rows = real * w
        cumsum, _ = jax.lax.scan(lambda c, v: (c + v, None), jnp.zeros(()), rows)   # zeros -> per replica
        counted = jax.lax.fori_loop(0, 3, lambda i, c: c + jnp.sum(rows), jnp.zeros(()))
        doubled = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 2), (0, jnp.sum(rows)))[1]
        schedule, _ = jax.lax.scan(lambda c, _: (c * w, None), jnp.ones(()), None, length=3)  # stays replicated
        return cumsum, counted, doubled, schedule, jax.grad(lambda w: jax.lax.scan(
            lambda c, v: (c + v * w, None), jnp.zeros(()), real)[0])(w)

    cumsum, counted, doubled, schedule, grad = s.run(step, args=(np.float32(2.0), batch))
    assert isinstance(schedule, ls.Mirrored) and float(np.asarray(schedule)) == 8.0
    np.testing.assert_allclose(s.reduce("SUM", cumsum), 2 * x[:, 0].sum(), rtol=1e-5)
    np.testing.assert_allclose(s.reduce("SUM", counted), 6 * x[:, 0].sum(), rtol=1e-5)
    np.testing.assert_allclose(s.reduce("SUM", doubled), 8 * x[:, 0].sum(), rtol=1e-5)
    assert isinstance(grad, ls.Mirrored)  # summed over replicas, as for any replicated input
    np.testing.assert_allclose(np.asarray(grad), x[:, 0].sum(), rtol=1e-5)
    with pytest.raises(TypeError, match="pytree structure"):  # other loop errors are untouched
        s.run(lambda b: jax.lax.scan(lambda c, v: ((c, c), None), jnp.zeros(()), b[:, 0]), args=(batch,))


def test_compute_average_loss_with_weights_and_explicit_global_batch_size():
    s = ls.MirroredStrategy(4)
    x = np.arange(6, dtype=np.float32)
    wts = np.array([1, 0, 2, 1, 1, 3], np.float32)
    batch = next(iter(s.experimental_distribute_dataset([(x, wts)])))
    out = s.run(lambda b: ls.compute_average_loss(b[0], sample_weight=b[1]), args=(batch,))
    np.testing.assert_allclose(s.reduce("SUM", out), np.sum(x * wts) / 6, rtol=1e-6)
    out = s.run(lambda b: ls.compute_average_loss(b[0], global_batch_size=10), args=(batch,))
    np.testing.assert_allclose(s.reduce("SUM", out), np.sum(x) / 10, rtol=1e-6)
    np.testing.assert_allclose(ls.compute_average_loss(x, sample_weight=wts), np.sum(x * wts) / 6)


def _mlp_init(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(size=(8, 16)).astype(np.float32) * 0.3, "b1": np.zeros(16, np.float32),
            "w2": rng.normal(size=(16, 3)).astype(np.float32) * 0.3, "b2": np.zeros(3, np.float32)}


def _mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def sgd_step(params, batch):
    x, y = batch

    def loss_fn(p):
        return ls.compute_average_loss(ls.losses.sparse_categorical_crossentropy(y, _mlp(p, x), from_logits=True))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss


def test_one_epoch_of_an_mlp_under_8_replicas_equals_single_device():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1003, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=1003)
    results = {}
    for name, strategy in [("one", ls.OneDeviceStrategy()), ("eight", ls.MirroredStrategy(8))]:
        params = _mlp_init()
        for batch in strategy.experimental_distribute_dataset(ls.data.batches((x, y), 64)):
            params, _ = strategy.run(sgd_step, args=(params, batch))
        results[name] = jax.tree.map(np.asarray, params)
    # an independent reference: plain JAX on the whole batches, no strategy at all
    params = _mlp_init()
    for i in range(0, 1003, 64):
        xb, yb = x[i:i + 64], y[i:i + 64]
        grads = jax.grad(lambda p: jnp.mean(-jax.nn.log_softmax(_mlp(p, xb))[np.arange(len(yb)), yb]))(params)
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    for name in results:
        for k in params:
            np.testing.assert_allclose(results[name][k], np.asarray(params[k]), rtol=2e-4, atol=2e-5)


def test_per_replica_state_carries_across_runs_without_recompiling():
    s = ls.MirroredStrategy(4)
    x = np.arange(20, dtype=np.float32)

    def accumulate(total, b):
        return total + jnp.sum(jnp.where(ls.get_replica_context().mask > 0, b, 0.0))

    total = np.float32(0)
    for batch in s.experimental_distribute_dataset(ls.data.batches(x, 8)):
        total = s.run(accumulate, args=(total, batch))
        assert isinstance(total, ls.PerReplica)
    assert float(s.reduce("SUM", total)) == x.sum()
    counts = s.extended.compile_counts(accumulate)
    # first call (replicated initial value) and later calls (per-replica) are two signatures
    assert len(counts) == 2
    assert all(c == 1 for c in counts)


def test_mirrored_local_results_repeat_the_value_per_replica():
    s = ls.MirroredStrategy(3)
    out = s.run(lambda: jnp.float32(7))
    assert isinstance(out, ls.Mirrored)
    assert [float(v) for v in s.experimental_local_results(out)] == [7.0, 7.0, 7.0]
    assert float(s.reduce("SUM", out)) == 21.0
    assert float(s.reduce("MEAN", out)) == 7.0


def test_many_steps_with_collectives_keep_dispatch_bounded():
    s = ls.MirroredStrategy(8)
    w = jnp.zeros(())
    x = np.ones(8, np.float32)
    batch = next(iter(s.experimental_distribute_dataset([x])))
    step = lambda w, b: w + ls.get_replica_context().all_reduce("SUM", jnp.sum(b))  # noqa: E731
    for _ in range(200):  # far beyond the ~32 steps in flight that wedge XLA's CPU collectives
        w = s.run(step, args=(w, batch))
        assert s.extended.steps_in_flight <= MAX_STEPS_IN_FLIGHT
    assert float(np.asarray(w)) == 200 * 8.0


def test_datasets_from_generators_dicts_and_functions():
    s = ls.MirroredStrategy(3)
    data = {"a": np.arange(10.0), "b": np.arange(10) % 2}

    def gen():
        for i in range(0, 10, 4):
            yield {k: v[i:i + 4] for k, v in data.items()}

    got = [s.gather(s.run(lambda b: b, args=(batch,))) for batch in s.experimental_distribute_dataset(gen())]
    np.testing.assert_array_equal(np.concatenate([g["a"] for g in got]), data["a"])
    np.testing.assert_array_equal(np.concatenate([g["b"] for g in got]), data["b"])

    seen = []

    def dataset_fn(ctx):
        seen.append(ctx)
        return ls.data.batches(data["a"], batch_size=ctx.get_per_replica_batch_size(6))  # TF's per-replica batches

    ds = s.distribute_datasets_from_function(dataset_fn)
    assert [b.num_real for b in ds] == [6, 4]  # a step takes one per-replica batch for each of the 3 replicas
    got = [s.experimental_local_results(b) for b in ds]
    np.testing.assert_array_equal(np.concatenate([r for step in got for r in step]), data["a"])
    assert (seen[0].num_input_pipelines, seen[0].input_pipeline_id, seen[0].num_replicas_in_sync) == (1, 0, 3)


def test_shuffled_batches_cover_every_sample_once_and_change_per_epoch():
    b = ls.data.batches(np.arange(50), batch_size=7, shuffle=True, seed=3)
    e1 = np.concatenate(list(b))
    e2 = np.concatenate(list(b))
    assert sorted(e1) == list(range(50)) and sorted(e2) == list(range(50))
    assert not np.array_equal(e1, e2)
    assert len(ls.data.batches(np.arange(50), 7, drop_remainder=True)) == 7


def test_scope_and_default_strategy():
    default = ls.get_strategy()
    assert isinstance(default, ls.OneDeviceStrategy)
    a, b = ls.MirroredStrategy(2), ls.MirroredStrategy(4)
    with a.scope():
        assert ls.get_strategy() is a
        with b.scope():
            assert ls.get_strategy() is b
        assert ls.get_strategy() is a
    assert ls.get_strategy() is default
    assert ls.MirroredStrategy().num_replicas_in_sync == 8
    assert ls.MirroredStrategy(["cpu:0", "/cpu:2"]).devices == (jax.devices()[0], jax.devices()[2])


# --- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_batch_size(bad):
    with pytest.raises(ValueError, match="batch_size"):
        ls.data.batches(np.arange(4), bad)


def test_arrays_of_different_lengths():
    with pytest.raises(ValueError, match=r"same length.*\[4, 5\]"):
        ls.data.batches((np.arange(4), np.arange(5)), 2)
    s = ls.MirroredStrategy(2)
    with pytest.raises(ValueError, match="same leading"):
        next(iter(s.experimental_distribute_dataset([(np.arange(4), np.arange(3))])))


def test_values_of_one_strategy_rejected_by_another():
    a, b = ls.MirroredStrategy(2), ls.MirroredStrategy(2)
    batch = next(iter(a.experimental_distribute_dataset([np.arange(4.0)])))
    v = a.run(lambda x: x, args=(batch,))
    with pytest.raises(ValueError, match="another strategy"):
        b.run(lambda x: x, args=(v,))
    with pytest.raises(ValueError, match="another strategy"):
        b.reduce("SUM", v)
    with pytest.raises(ValueError, match="another strategy"):
        b.run(lambda x: x, args=(batch,))


def test_unknown_reduce_op_and_bad_axis():
    s = ls.MirroredStrategy(2)
    with pytest.raises(ValueError, match="op.*'median'"):
        s.reduce("median", np.ones(2))
    with pytest.raises(ValueError, match="axis"):
        s.reduce("SUM", np.ones(2), axis=1)


def test_simulate_cpu_devices_after_jax_started():
    jax.devices()
    ls.simulate_cpu_devices(8)  # the number in force: fine
    with pytest.raises(ls.UsageError, match="after JAX started"):
        ls.simulate_cpu_devices(4)
    with pytest.raises(ValueError, match="n=0"):
        ls.simulate_cpu_devices(0)


def test_bad_device_arguments():
    with pytest.raises(ValueError, match="devices=9"):
        ls.MirroredStrategy(9)
    with pytest.raises(ValueError, match="twice"):
        ls.MirroredStrategy([0, 0])
    with pytest.raises(TypeError, match="fn"):
        ls.MirroredStrategy(2).run(3)


def test_combinations_are_swept():
    # guard against the sweep above silently shrinking
    assert len(list(itertools.product(REPLICAS, SIZES))) == 30


def _identity(b):
    return b


def test_prefetching_keeps_order_stops_early_and_surfaces_errors(monkeypatch):
    from lockstep.engine import _prefetch

    s = ls.MirroredStrategy(2)
    assert _prefetch.prefetch_depth(s.devices) == (
        0 if _prefetch.PREFETCH is None else int(_prefetch.PREFETCH))  # CPU devices: no prefetch thread by default
    monkeypatch.setattr(_prefetch, "PREFETCH", "2")
    x = np.arange(40, dtype=np.float32)
    got, threads = [], set()
    for b in s.experimental_distribute_dataset(ls.data.batches(x, 6)):
        threads.update(t.name for t in threading.enumerate())
        got.append(np.asarray(s.gather(s.run(_identity, args=(b,)))))
    assert "lockstep-prefetch" in threads
    np.testing.assert_array_equal(np.concatenate(got), x)
    it = iter(s.experimental_distribute_dataset(ls.data.batches(x, 4)))
    next(it)
    it.close()  # a consumer that stops early stops the producer
    assert not any(t.name == "lockstep-prefetch" for t in threading.enumerate())

    def broken():
        yield np.ones(4, np.float32)
        raise RuntimeError("pipeline broke at batch 2")

    with pytest.raises(RuntimeError, match="batch 2"):
        for _ in s.experimental_distribute_dataset(broken()):
            pass
    with pytest.raises(ValueError, match="same leading"):
        list(s.experimental_distribute_dataset([(np.ones(4), np.ones(3))]))


def test_tpu_strategy_without_a_tpu_names_mirrored_strategy():
    with pytest.raises(RuntimeError, match=r"TPUStrategy needs TPU devices.*8 cpu device.*MirroredStrategy\(\)"):
        ls.TPUStrategy()
    with pytest.raises(ValueError, match=r"`tpu` must be None, '' or 'local'.*grpc://10.0.0.2:8470"):
        ls.TPUStrategy("grpc://10.0.0.2:8470")


def test_tpu_strategy_is_the_mirrored_engine_on_the_devices_it_finds(monkeypatch):
    """CPU devices stand in for TPU cores (no TPU here): TPUStrategy then trains exactly as
    MirroredStrategy does on the same devices."""
    import lockstep.distribute._tpu as strategy_module

    monkeypatch.setattr(strategy_module, "_tpu_devices", lambda: list(jax.devices()[:4]))
    x = np.random.default_rng(0).normal(size=(103, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def weights(strategy):
        model = ls.FunctionalModel(lambda key, x: {"w": jax.random.normal(key, (5, 2)) * 0.1},
                                   lambda p, x, training=False: x @ p["w"])
        trainer = ls.Trainer(model, loss="sparse_categorical_crossentropy_from_logits", strategy=strategy)
        trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
        return trainer.get_weights()["w"]

    tpu = ls.TPUStrategy()
    assert tpu.num_replicas_in_sync == 4
    np.testing.assert_array_equal(weights(tpu), weights(ls.MirroredStrategy(4)))
