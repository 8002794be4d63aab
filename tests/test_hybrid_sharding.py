"""Hybrid sharding (HSDP: `ShardedStrategy(replica_dim_name=...)`) on a 3-D mesh of replicas x
ZeRO shards x model of 8 simulated devices: whole copies of the ZeRO-sharded model along the
replica axis, ZeRO along the batch axis within each copy, rows split along both. Equal to one
device (Keras' own `fit`), replicas with no row included; each device holds its copy's shards;
state moves between hybrid, plain ZeRO and one device; bad axes are named before any step."""

import os
import shutil

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lockstep as ls
from keras_reference import assert_equals_one_device, assert_weights_close
from sharded_cases import (MODELS, Preempted, backed_up_fit, case_data, keras_fit, mlp, sharded_fit,
                           sharded_strategy, used_rules)
from suite import variants

HYBRID = [(2, 4, 1), (4, 2, 1), (2, 2, 2)]
CASES = [(m, shape, stage) for m in MODELS for shape in HYBRID for stage in (1, 2, 3)] + [
    ("mlp", shape, 3) for shape in [(2, 1, 4), (1, 4, 2), (8, 1, 1), (1, 8, 1)]]  # an axis of one device


@pytest.mark.parametrize("model_name,shape,stage", variants(CASES, {
    ("mlp", (2, 4, 1), 3)}))  # the rest: `make test-full` (a CNN + BatchNorm below, with replicas without rows)
def test_hybrid_sharding_equals_keras_own_fit_on_one_device(model_name, shape, stage):
    x, y = case_data(model_name)
    want = keras_fit(MODELS[model_name], x, y)
    trainer, got = sharded_fit(MODELS[model_name], sharded_strategy(shape, stage, used_rules(model_name),
                                                                    max_replicated_fraction=1.0), x, y)
    assert_equals_one_device(got, want, rtol=2e-5, atol=5e-6)
    assert trainer.layouts.zero_axis == "batch" and trainer.layouts.replica_axes == ("replica",)
    assert "whole copies along ('replica',)" in trainer.layouts.report()


def _no_rows_equal_keras(n, shape, stage):
    x, y = case_data("cnn", n=n)
    want = keras_fit(MODELS["cnn"], x, y)
    _, got = sharded_fit(MODELS["cnn"], sharded_strategy(shape, stage, used_rules("cnn"), max_replicated_fraction=1.0),
                         x, y)
    assert_equals_one_device(got, want, rtol=2e-5, atol=5e-6)


@pytest.mark.parametrize("n,shape,stage", [(1, (2, 4, 1), 3), (13, (2, 2, 2), 2)])
def test_replicas_holding_no_row_change_nothing(n, shape, stage):
    """A CNN with BatchNorm against Keras' own fit: N=1 (7 of the 8 replicas of (2, 4, 1) hold only
    padding), N=13 (a last batch of 5 rows over 4 replicas of (2, 2, 2))."""
    _no_rows_equal_keras(n, shape, stage)


@pytest.mark.full_suite
@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 13), shape=st.sampled_from(HYBRID), stage=st.sampled_from([2, 3]))
def test_replicas_holding_no_row_change_nothing_for_any_n(n, shape, stage):
    _no_rows_equal_keras(n, shape, stage)


def test_each_copy_holds_its_zero_shards_and_the_copies_are_equal():
    """On (2 copies, 4 ZeRO shards, 1): every split variable and its Adam state lies in quarters
    along "batch", the same quarter on the two devices of each index along "replica"; the estimate
    says so before anything is placed."""
    x, y = case_data("mlp")
    strategy = sharded_strategy((2, 4, 1), 3, {}, min_shard_size=1, max_replicated_fraction=1.0)
    trainer, _ = sharded_fit(mlp, strategy, x, y)
    state = trainer.train_state
    devices = np.asarray(strategy.extended.mesh.devices)  # (replica, batch, model)
    split = 0
    for a in jax.tree.leaves((state.params, state.opt_state)):
        if a.ndim == 0 or a.sharding.is_fully_replicated:
            continue
        split += 1
        shards = {s.device: s for s in a.addressable_shards}
        assert {s.data.size for s in shards.values()} == {a.size // 4}
        for b in range(4):  # the two copies of quarter b hold the same rows of it
            one, other = shards[devices[0, b, 0]], shards[devices[1, b, 0]]
            assert one.index == other.index
            np.testing.assert_array_equal(np.asarray(one.data), np.asarray(other.data))
    assert split >= 4 * 3  # kernels and biases, and Adam's two moments of each
    device0 = devices[0, 0, 0]
    held = sum(s.data.nbytes for a in jax.tree.leaves((state.params, state.opt_state))
               for s in a.addressable_shards if s.device == device0)
    estimate = ls.memory_estimate(trainer.model, "adam", strategy)
    assert abs(estimate["parameters"] + estimate["optimizer_state"] - held) <= 64  # Adam's step count aside


def test_state_moves_between_hybrid_zero_and_one_device_and_the_run_goes_on(tmp_path):
    """A backup of a hybrid run resumes on plain ZeRO-3 and on one device, and a plain ZeRO backup
    on a hybrid mesh, each ending with the uninterrupted run's weights."""
    x, y = case_data("mlp")
    rules = used_rules("mlp")
    _, (whole, _) = sharded_fit(mlp, sharded_strategy((2, 2, 2), 3, rules), x, y, epochs=2)

    def fit(strategy, where, cut_short=False):
        return backed_up_fit(strategy, tmp_path / where, x, y, cut_short=cut_short)

    for strategy, where in [(sharded_strategy((2, 2, 2), 3, rules), "hybrid"), (sharded_strategy((8, 1), 2, rules), "zero")]:
        with pytest.raises(Preempted):
            fit(strategy, where, cut_short=True)
    for strategy, where in [(sharded_strategy((8, 1), 3, rules), "hybrid"), (ls.OneDeviceStrategy(), "hybrid"),
                            (sharded_strategy((4, 2, 1), 3, rules), "zero")]:
        shutil.copytree(tmp_path / where, tmp_path / "resumed")  # a finished fit deletes its backup
        resumed, backup = fit(strategy, "resumed")
        assert backup.restored_from == 5  # the backup of epoch 1 (5 steps of 8 rows)
        assert_weights_close(resumed.get_weights(), whole, atol=5e-6)
        shutil.rmtree(tmp_path / "resumed", ignore_errors=True)


@pytest.mark.parametrize("kw,message", [
    (dict(replica_dim_name="copies"), "`replica_dim_name` 'copies' is not an axis of the mesh"),
    (dict(replica_dim_name="batch"), "must be two mesh axes"),
    (dict(replica_dim_name="replica", layout_map={".*dense.*/kernel": (None, "replica")}),
     "along the batch axis 'replica'")])
def test_bad_replica_axes_are_named_before_any_step(kw, message):
    mesh = ls.DeviceMesh((2, 2, 2), ("replica", "batch", "model"))
    with pytest.raises(ls.UsageError, match=message):
        ls.ShardedStrategy(mesh=mesh, zero_stage=3, **kw)


def test_run_returns_per_replica_values_that_differ_along_one_of_the_batch_axes():
    """`strategy.run` on (2 copies x 2 ZeRO shards x 2): a value summed along "replica" still
    differs along "batch", so it comes back per replica; summed along both it is replicated."""
    strategy = sharded_strategy((2, 2, 2), 3, {})
    assert strategy.num_replicas_in_sync == 4

    def fn():
        ctx = ls.get_replica_context()
        r = jax.numpy.float32(ctx.replica_id_in_sync_group)
        return jax.lax.psum(r, "replica"), jax.lax.psum(r, ("replica", "batch"))
    along_one, along_both = strategy.run(fn)
    assert [float(v) for v in strategy.experimental_local_results(along_one)] == [2.0, 4.0, 2.0, 4.0]
    assert float(np.asarray(along_both)) == 6.0
