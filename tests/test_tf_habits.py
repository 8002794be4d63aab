"""TensorFlow and Keras habits ported as written: TF's documented numbers, or a clear error.

Each test is one case a TF user hit (issue 12); the expected numbers come from NumPy or from
one device, never from lockstep's own multi-replica path.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lockstep as ls

REPLICAS = [1, 3, 4, 8]


def _xw(n=7):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 10
    return x, jnp.asarray([1.0, -2.0, 0.5])


# --- silent wrong numbers --------------------------------------------------------------------
@pytest.mark.parametrize("r", REPLICAS)
def test_arrays_passed_straight_to_run_give_the_whole_batch_gradient(r):
    """Seed 001: `strategy.run(step, args=(x, y))` with plain arrays; every replica holds them
    whole. TF's `compute_average_loss` + all-reduce gives the batch's gradient (was 1/R)."""
    s = ls.MirroredStrategy(r)
    x, w = _xw()
    true_loss, true_grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)

    def step(w, x):
        return jax.value_and_grad(lambda w: ls.compute_average_loss((x @ w) ** 2))(w)
    loss, grad = s.run(step, args=(w, x))
    for g in s.experimental_local_results(grad):
        np.testing.assert_allclose(g, true_grad, rtol=1e-6)
    np.testing.assert_allclose(s.reduce("SUM", loss, axis=None), true_loss, rtol=1e-6)


@pytest.mark.parametrize("r", [2, 4])
def test_a_tf_style_all_reduce_of_gradients_warns_that_they_are_already_summed(r):
    s = ls.MirroredStrategy(r)
    x, w = _xw(8)
    batch = next(iter(s.experimental_distribute_dataset([x])))
    true_grad = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

    def step(w, b):
        grads = jax.grad(lambda w: ls.compute_average_loss((b @ w) ** 2))(w)
        return grads, ls.get_replica_context().all_reduce("SUM", grads)
    with pytest.warns(UserWarning, match=r"already the same on every replica.*use the gradients as they are"):
        grads, summed = s.run(step, args=(w, batch))
    np.testing.assert_allclose(s.experimental_local_results(grads)[0], true_grad, rtol=1e-5)
    np.testing.assert_allclose(s.experimental_local_results(summed)[0], r * true_grad, rtol=1e-5)


def test_all_reduce_of_per_replica_values_and_of_integers_does_not_warn():
    s = ls.MirroredStrategy(4)
    batch = next(iter(s.experimental_distribute_dataset([np.arange(8.0)])))
    ctx_sum = lambda b: (ls.get_replica_context().all_reduce("SUM", b.sum()),  # noqa: E731
                         ls.get_replica_context().all_reduce("SUM", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        total, replicas = s.run(ctx_sum, args=(batch,))
    assert float(np.asarray(total)) == 28.0 and int(np.asarray(replicas)) == 4


@pytest.mark.parametrize("call", ["reduce", "gather", "experimental_local_results"])
def test_reading_distributed_values_inside_run_is_a_usage_error(call):
    """`strategy.reduce` inside `run` returned per-replica partial sums ([4, 20, 36, 52], true 28)."""
    s = ls.MirroredStrategy(4)
    batch = next(iter(s.experimental_distribute_dataset([np.arange(8.0)])))
    fns = {"reduce": lambda b: s.reduce("SUM", b, axis=None), "gather": lambda b: s.gather(b),
           "experimental_local_results": lambda b: s.experimental_local_results(b)}
    with pytest.raises(ls.UsageError, match=f"`strategy.{call}` was called inside `strategy.run`"):
        s.run(fns[call], args=(batch,))


def test_nested_run_is_a_usage_error_not_a_hang():
    s = ls.MirroredStrategy(2)
    batch = next(iter(s.experimental_distribute_dataset([np.arange(4.0)])))
    with pytest.raises(ls.UsageError, match="inside another `strategy.run`"):
        s.run(lambda b: s.run(lambda c: c, args=(b,)), args=(batch,))


# --- TF's shapes -------------------------------------------------------------------------------
@pytest.mark.parametrize("r", [1, 3])
def test_local_results_of_a_structure_are_one_whole_structure_per_replica(r):
    """TF 2.21 returns a tuple with one whole structure per replica (was: a tuple at every leaf)."""
    s = ls.MirroredStrategy(r)
    x = np.arange(3 * r, dtype=np.float32)
    batch = next(iter(s.experimental_distribute_dataset([x])))
    out = s.run(lambda b: {"rows": b, "pair": (b * 2, ls.get_replica_context().all_reduce("SUM", b.sum()))},
                args=(batch,))
    local = s.experimental_local_results(out)
    assert isinstance(local, tuple) and len(local) == r
    for i, rep in enumerate(local):
        assert set(rep) == {"rows", "pair"} and isinstance(rep["pair"], tuple)
        np.testing.assert_array_equal(rep["rows"], x[3 * i:3 * i + 3])
        np.testing.assert_array_equal(rep["pair"][0], 2 * x[3 * i:3 * i + 3])
        assert float(rep["pair"][1]) == x.sum()
    plain = np.ones(2)
    assert s.experimental_local_results(plain)[0] is plain and len(s.experimental_local_results(plain)) == 1
