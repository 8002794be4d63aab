"""Unit tests of the state's layout (`lockstep.sharding.state_layout`) against arithmetic done by
hand: where each array lies, the padding that a split which does not divide a variable adds (zeros,
cut away again on the way out), the optimizer state laid out as its parameter, and the bytes each
device holds. A (9, 5) kernel and a (5,) bias on 4 replicas: ZeRO divides neither, so both are
stored padded (9 -> 12 rows, 5 -> 8)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import lockstep as ls
from lockstep.sharding import state_layout

W = np.arange(45, dtype=np.float32).reshape(9, 5)
B = np.arange(5, dtype=np.float32) + 100
PARAMS = {"trainable": {"b": B, "w": W}, "non_trainable": {"n": np.ones((), np.float32)}}
PATHS = {"trainable": {"b": "dense/bias", "w": "dense/kernel"}, "non_trainable": {"n": "n"}}
F = 4  # bytes of a float32


def _layout(stage):
    if stage is None:
        engine = ls.MirroredStrategy(4).extended
    else:
        engine = ls.ShardedStrategy(mesh=ls.DeviceMesh((4, 1), ("batch", "model")), zero_stage=stage,
                                    min_shard_size=1, max_replicated_fraction=1.0).extended
    return state_layout(engine, engine.sharding, optax.adam(0.1), PARAMS, PATHS)


def _shard_shapes(a):
    return {tuple(s.data.shape) for s in a.addressable_shards}


def test_data_parallelism_is_the_layout_in_which_every_array_is_whole():
    layout = _layout(None)
    assert type(layout).__name__ == "Replicated" and layout.plan is None
    params = layout.params(PARAMS)
    opt_state = layout.init_opt_state(params)
    for a in jax.tree.leaves((params, opt_state)):
        assert a.sharding.spec == P() and _shard_shapes(a) == {a.shape}
    np.testing.assert_array_equal(np.asarray(layout.unpadded_params(params)["trainable"]["w"]), W)
    whole = (45 + 5) * F
    assert layout.estimate(PARAMS) == {"parameters": whole + F, "gradients": whole, "optimizer_state": 2 * whole + 4,
                                       "total": 4 * whole + F + 4}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_zero_stage_pads_what_it_cannot_divide_and_cuts_it_away_on_the_way_out(stage):
    layout = _layout(stage)
    assert type(layout).__name__ == "Sharded" and layout.plan.zero_stage == stage
    params = layout.params(PARAMS)
    w, b = params["trainable"]["w"], params["trainable"]["b"]
    if stage == 3:  # the parameters themselves split: stored padded with zeros, a quarter on each device
        assert w.shape == (12, 5) and _shard_shapes(w) == {(3, 5)} and b.shape == (8,) and _shard_shapes(b) == {(2,)}
        np.testing.assert_array_equal(np.asarray(w)[9:], 0)
        np.testing.assert_array_equal(np.asarray(b)[5:], 0)
    else:  # whole on every device
        assert w.shape == (9, 5) and _shard_shapes(w) == {(9, 5)}
    unpadded = layout.unpadded_params(params)
    np.testing.assert_array_equal(np.asarray(unpadded["trainable"]["w"]), W)
    np.testing.assert_array_equal(np.asarray(unpadded["trainable"]["b"]), B)
    opt_state = layout.init_opt_state(params)
    mu = opt_state[0].mu
    assert mu["w"].shape == (12, 5) and _shard_shapes(mu["w"]) == {(3, 5)}  # every stage splits the state
    assert _shard_shapes(opt_state[0].count) == {()}
    own = (PARAMS, optax.adam(0.1).init(PARAMS["trainable"]))  # every array in its variable's own shape
    assert layout.shapes(params, opt_state) == [np.shape(a) for a in jax.tree.leaves(own)]
    quarter = (3 * 5 + 2) * F  # a device's share of the padded kernel and bias
    whole = (45 + 5) * F
    assert layout.estimate(PARAMS) == {
        "parameters": (quarter if stage == 3 else whole) + F,
        "gradients": quarter if stage >= 2 else whole,
        "optimizer_state": 2 * quarter + 4,
        "total": (quarter if stage == 3 else whole) + F + (quarter if stage >= 2 else whole) + 2 * quarter + 4}
