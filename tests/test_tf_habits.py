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
from suite import variants

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



def test_a_distributed_batch_unpacks_on_the_host_as_in_tf():
    """`for images, labels in dist_ds` raised `cannot unpack non-iterable DistributedBatch`."""
    s = ls.MirroredStrategy(4)
    x, y = np.arange(10.0).reshape(5, 2), np.arange(5)
    for features, labels in s.experimental_distribute_dataset([(x, y)]):
        out = s.run(lambda f, lab: f.sum(1) * lab, args=(features, labels))
        np.testing.assert_array_equal(s.gather(out), x.sum(1) * y)  # padding rows dropped, order kept
    other = next(iter(s.experimental_distribute_dataset([(x, y)])))
    with pytest.raises(ValueError, match="parts of one distributed batch"):
        s.run(lambda a, b: a, args=(features, other[1]))


def test_mirrored_outputs_are_used_as_arrays():
    s = ls.MirroredStrategy(3)
    ctx = ls.get_replica_context
    m = s.run(lambda: ctx().all_reduce("SUM", jnp.arange(3.0) * (ctx().replica_id_in_sync_group + 1)))
    assert isinstance(m, ls.Mirrored) and m.shape == (3,)
    np.testing.assert_array_equal(np.asarray(m * 2 - 1), [-1.0, 11.0, 23.0])
    assert float(m[1]) == 6.0 and float(np.sum(m)) == 18.0 and float(jnp.sum(jnp.asarray(m))) == 18.0


def test_multi_worker_strategy_with_no_cluster_is_one_worker_as_in_tf(monkeypatch):
    """It raised `no cluster found`; TF runs it as a single worker on the local devices."""
    for var in ("LOCKSTEP_COORDINATOR_ADDRESS", "TF_CONFIG", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    s = ls.MultiWorkerMirroredStrategy()
    assert (s.num_workers, s.worker_index, s.num_replicas_in_sync) == (1, 0, 8)
    batch = next(iter(s.experimental_distribute_dataset([np.arange(11.0)])))
    assert float(s.reduce("SUM", s.run(lambda b: b, args=(batch,)), axis=0)) == 55.0

# --- labels checked on the host ----------------------------------------------------------------
def _classifier(classes=3):
    return ls.FunctionalModel(
        init=lambda key, x: {"w": jax.random.normal(key, (x.shape[-1], classes)) * 0.1},
        apply=lambda p, x, training=False: x @ p["w"])


_X = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
_Y = np.array([0, 1, 2, 1, 0, 2, 2, 1, 0, 1])
BAD_LABELS = {  # loss, labels, the bad row, the message ({where}: the row, and the batch for iterables)
    "negative": ("sparse_categorical_crossentropy_from_logits", np.where(np.arange(10) == 7, -1, _Y), 7,
                 r"holds label -1 \(at index {where}\), outside the 3 classes"),
    "too large": ("sparse_categorical_crossentropy_from_logits", np.where(np.arange(10) == 4, 3, _Y), 4,
                  r"holds label 3 \(at index {where}\), outside the 3 classes"),
    "float": ("sparse_categorical_crossentropy_from_logits", np.where(np.arange(10) == 6, 0.7, _Y), 6,
              r"holds float label 0.7 \(at index {where}\).*truncated"),
    "one-hot for sparse": ("sparse_categorical_crossentropy_from_logits", np.eye(3)[_Y], None,
                           r"looks one-hot \(shape \({rows}, 3\){batch}\).*'categorical_crossentropy'"),
    "sparse for categorical": ("categorical_crossentropy_from_logits", _Y, None,
                               r"has shape \({rows},\){batch} but a categorical loss over 3 classes.*'sparse_categorical"),
}


@pytest.mark.parametrize("case", sorted(BAD_LABELS))
@pytest.mark.parametrize("entry", ["fit", "evaluate", "fit on batches", "fit on a distributed dataset",
                                   "validation_data"])
def test_labels_a_named_loss_cannot_take_are_a_clear_error(case, entry):
    """On CPU/GPU the loss took another number (or NaN) silently; TF raises for the first two."""
    loss, y, row, message = BAD_LABELS[case]
    s = ls.MirroredStrategy(2)
    t = ls.Trainer(_classifier(), optimizer="sgd", loss=loss, strategy=s)
    good = np.eye(3)[_Y] if loss.startswith("categorical") else _Y
    two_batches = [(_X[:4], good[:4]), (_X[4:], y[4:])]  # the bad labels in the second
    calls = {
        "fit": lambda: t.fit(_X, y, batch_size=4, verbose=0),
        "evaluate": lambda: t.evaluate(_X, y, batch_size=4),
        "fit on batches": lambda: t.fit(two_batches, verbose=0),
        "fit on a distributed dataset": lambda: t.fit(s.experimental_distribute_dataset(two_batches), verbose=0),
        "validation_data": lambda: t.fit(_X, good, validation_data=(_X, y), batch_size=4, verbose=0),
    }
    batched = entry in ("fit on batches", "fit on a distributed dataset")
    arg = {"validation_data": "validation_data"}.get(entry, "x" if batched else "y")
    where = f"{row - 4} of batch 2" if batched and row is not None else str(row)
    pattern = message.format(where=where, rows=6 if batched else 10, batch=" of batch 2" if batched else "")
    with pytest.raises(ValueError, match=f"`{arg}` {pattern}"):
        calls[entry]()


def test_good_labels_pass_the_check_float_integers_included():
    t = ls.Trainer(_classifier(), optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(2))
    out = t.evaluate(_X, _Y.astype(np.float32), batch_size=4)
    logits = _X @ np.asarray(t.get_weights()["w"])
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(out["loss"], -logp[np.arange(10), _Y].mean(), rtol=1e-5)


# --- data that runs out, one-shot sources, launched scripts ---------------------------------
def _linear():
    return ls.FunctionalModel(init=lambda key, x: {"w": jnp.zeros((x.shape[-1], 2))},
                              apply=lambda p, x, training=False: x @ p["w"])


def test_steps_per_epoch_goes_on_across_epochs_and_an_epoch_ends_with_its_pass():
    """10 samples in batches of 4 are 3 steps; `steps_per_epoch=5` ran 3 silently, and epoch 2
    started the data again where Keras continues it. Now the stream goes on across epochs, and an
    epoch ends where a pass ends, with a warning, as Keras 3's does (`test_keras_settings` compares
    with Keras' own fit): each epoch of 5 steps here is one pass of 3."""
    x, y = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32), np.arange(10) % 2
    t = ls.Trainer(_linear(), optimizer="sgd", strategy=ls.MirroredStrategy(2))
    with pytest.warns(UserWarning, match=r"a pass over the training data ended after 3 of `steps_per_epoch=5` "
                                         r"steps in epoch 1: the epoch ends there"):
        t.fit(x, y, batch_size=4, epochs=2, steps_per_epoch=5, shuffle=False, verbose=0)
    assert t.global_step == 6
    cuts = [(0, 4), (4, 8), (8, 10)] * 4
    ref = ls.Trainer(_linear(), optimizer="sgd", strategy=ls.OneDeviceStrategy())
    ref.fit([(x[a:b], y[a:b]) for a, b in cuts[:6]], epochs=1, verbose=0)
    np.testing.assert_allclose(t.get_weights()["w"], ref.get_weights()["w"], rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t2 = ls.Trainer(_linear(), optimizer="sgd", strategy=ls.MirroredStrategy(2))
        t2.fit(x, y, batch_size=4, epochs=3, steps_per_epoch=1, shuffle=False, verbose=0)  # epoch 2 goes on
        ref2 = ls.Trainer(_linear(), optimizer="sgd", strategy=ls.OneDeviceStrategy())
        ref2.fit([(x[a:b], y[a:b]) for a, b in cuts[:3]], epochs=1, verbose=0)
        np.testing.assert_allclose(t2.get_weights()["w"], ref2.get_weights()["w"], rtol=1e-6)
        gen = ((x[:4], y[:4]) for _ in range(4))  # a generator goes on across epochs, as in Keras
        t.fit(gen, epochs=2, steps_per_epoch=2, verbose=0)


def test_a_generator_shorter_than_promised_is_an_error():
    """Keras warns and stops; a run that silently trained fewer steps than asked is an error here."""
    t = ls.Trainer(_linear(), optimizer="sgd", strategy=ls.MirroredStrategy(2))
    x, y = np.ones((4, 3), np.float32), np.zeros(4, int)
    gen = ((x, y) for _ in range(3))
    with pytest.raises(ValueError, match=r"ran out after 1 of `steps_per_epoch=2` steps in epoch 2"):
        t.fit(gen, epochs=2, steps_per_epoch=2, verbose=0)
    assert t.global_step == 3


def test_a_used_up_generator_in_a_distributed_dataset_is_an_error_on_the_next_pass():
    """The second pass yielded nothing, silently (TF accepts only re-iterable datasets here)."""
    s = ls.MirroredStrategy(2)
    ds = s.experimental_distribute_dataset(np.arange(4.0) for _ in range(3))
    assert len(list(ds)) == 3
    with pytest.raises(ValueError, match="one-shot generator .* an earlier pass used up"):
        list(ds)
    again = s.experimental_distribute_dataset([np.arange(4.0)] * 3)  # re-iterable: every pass
    assert len(list(again)) == len(list(again)) == 3
    shuffled = ls.data.batches(np.arange(8.0), 4, shuffle=True, seed=3)  # each pass is the next epoch
    def identity(b):
        return b
    passes = [np.concatenate([np.asarray(s.gather(s.run(identity, args=(b,)))) for b in
                              s.experimental_distribute_dataset(shuffled)]) for _ in range(2)]
    for epoch, seen in enumerate(passes):
        np.testing.assert_array_equal(seen, shuffled.order(epoch))


def test_simulate_cpu_devices_disagreeing_with_the_launcher_is_an_error(monkeypatch):
    """In a script started by `lockstep launch --devices-per-proc 2` the call was ignored silently."""
    monkeypatch.setenv("LOCKSTEP_DEVICES_PER_PROC", "2")
    with pytest.raises(ls.UsageError, match=r"simulate_cpu_devices\(4\).*--devices-per-proc 2"):
        ls.simulate_cpu_devices(4)


# --- Keras habits: compile in the scope, then train ---------------------------------------------
def _keras_mlp(keras):
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


@pytest.mark.parametrize("optimizer", variants(["adam", "sgd_nesterov", "adamw_clipnorm"], {"adamw_clipnorm"}))
def test_a_trainer_on_a_compiled_keras_model_trains_as_keras_fit_does(optimizer):
    """Seed 004: `model.compile(optimizer="adam", loss=..., metrics=["accuracy"])` in the scope, then
    `ls.Trainer(model)`: the compiled optimizer, loss and metrics were ignored (lockstep's defaults)."""
    import keras

    make = {"adam": lambda: "adam",
            "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
            "adamw_clipnorm": lambda: keras.optimizers.AdamW(0.01, clipnorm=1.0)}[optimizer]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(103, 6)).astype("float32"), rng.integers(0, 3, 103)
    compile_args = lambda: dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),  # noqa: E731
                                metrics=["accuracy"])
    reference = _keras_mlp(keras)
    w0 = reference.get_weights()
    reference.compile(optimizer=make(), **compile_args())
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    s = ls.MirroredStrategy(4)
    with s.scope():
        model = _keras_mlp(keras)
        model.set_weights(w0)
        model.compile(optimizer=make(), **compile_args())
    trainer = ls.Trainer(model)
    got = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert sorted(got) == ["accuracy", "loss"]
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=2e-6)
    np.testing.assert_allclose(got["accuracy"], expected["accuracy"])
    for a, b in zip(trainer.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    trainer.learning_rate = 0.5  # a Keras optimizer's learning rate is read and set like a named one's
    assert trainer.learning_rate == 0.5


def test_keras_fit_inside_a_lockstep_scope_runs_through_lockstep():
    """Keras' `model.fit` in the scope raised Keras' IndivisibleError on the short last batch (10
    rows, batches of 4, 4 replicas); lockstep runs it, as `ls.Trainer(model).fit` does."""
    import keras

    s = ls.MirroredStrategy(4)
    x, y = np.random.default_rng(0).normal(size=(10, 6)).astype("float32"), np.arange(10) % 3
    weights = []
    for how in ("model.fit", "Trainer"):
        with s.scope():
            keras.utils.set_random_seed(0)
            model = _keras_mlp(keras)
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            assert model(x).shape == (10, 3)  # calling the model is fine
            if how == "model.fit":
                model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        if how == "Trainer":
            ls.Trainer(model).fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


# --- metrics' functional face without shapes ---------------------------------------------------
@pytest.mark.parametrize("r", [1, 3])
def test_functional_metrics_without_shapes_are_shaped_by_their_first_update_inside_run(r):
    """`F1Score(average="macro").init()` and `R2Score().init()` raised 'does not know its state's shape'."""
    from sklearn.metrics import f1_score, r2_score

    s = ls.MirroredStrategy(r)
    rng = np.random.default_rng(1)
    y, p = rng.integers(0, 3, 11), rng.normal(size=(11, 3)).astype(np.float32)
    t, u = rng.normal(size=11).astype(np.float32), rng.normal(size=11).astype(np.float32)
    f1, r2 = ls.metrics.F1Score(average="macro"), ls.metrics.R2Score()
    assert float(f1.compute(f1.init())) == 0.0  # nothing seen: 0, as Keras reports
    fs, rs = f1.init(), r2.init()
    for batch in s.experimental_distribute_dataset(ls.data.batches((y, p, t, u), 4)):
        fs, rs = s.run(lambda fs, rs, b: (f1.update(fs, b[0], b[1]), r2.update(rs, b[2], b[3])),
                       args=(fs, rs, batch))
    np.testing.assert_allclose(f1.compute(fs), f1_score(y, p.argmax(1), average="macro"), rtol=1e-5)
    np.testing.assert_allclose(r2.compute(rs), r2_score(t, u), rtol=1e-5)


# --- cryptic errors made clear -------------------------------------------------------------------
_x4, _y2 = np.ones((10, 4), np.float32), np.zeros(10, int)
CRYPTIC = {  # what was given -> (call, error type, message); each was an error from deep inside before
    "validation_data=(x,)": (lambda t: t.fit(_x4, _y2, validation_data=(_x4,), verbose=0), ValueError,
                             r"`validation_data` must be \(x, y\).*got a tuple of 1 arrays"),
    "string x": (lambda t: t.fit(np.array(["a"] * 10), _y2, verbose=0), TypeError, r"`x` holds <U1 values, not numbers"),
    "feature count": (lambda t: t.fit(np.ones((10, 5), np.float32), _y2, verbose=0), ValueError,
                      r"`x` has samples of shape \(5,\), which the model cannot take"),
    "lists": (lambda t: t.fit(_x4.tolist(), _y2.tolist(), verbose=0), TypeError,
              r"`x` is a Python list and `y` is given: pass NumPy arrays"),
    "verbose='loud'": (lambda t: t.fit(_x4, _y2, verbose="loud"), ValueError, r"`verbose` must be 0, 1, 2 or 'auto'"),
    "nested dict": (lambda t: t.fit({"a": {"b": _x4}}, _y2, verbose=0), ValueError,
                    r"`x` has samples of shape \{'a': \{'b': \(4,\)\}\}, which the model cannot take"),
}


@pytest.mark.parametrize("case", sorted(CRYPTIC))
def test_bad_input_gets_an_error_naming_the_argument(case):
    call, kind, message = CRYPTIC[case]
    t = ls.Trainer(_linear4(), optimizer="sgd", strategy=ls.MirroredStrategy(2))
    with pytest.raises(kind, match=message):
        call(t)


def _linear4():
    return ls.FunctionalModel(init=lambda key, x: {"w": jnp.zeros((4, 2))},
                              apply=lambda p, x, training=False: x @ p["w"])


def test_nested_dict_inputs_and_an_apply_without_training_train():
    """`apply(params, x)` (no `training`) raised `unexpected keyword argument 'training'`."""
    model = ls.FunctionalModel(init=lambda key, x: {"w": jnp.zeros((4, 2))},
                               apply=lambda p, x: x["a"]["b"] @ p["w"])
    t = ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(2))
    out = t.evaluate({"a": {"b": _x4}}, _y2, batch_size=4)
    np.testing.assert_allclose(out["loss"], np.log(2.0), rtol=1e-6)  # zero weights: uniform over 2 classes


def test_launch_with_zero_devices_per_process_is_refused(tmp_path):
    """`lockstep launch --devices-per-proc 0` segfaulted silently in the workers."""
    from lockstep.launch import launch

    script = tmp_path / "s.py"
    script.write_text("print('never runs')\n")
    with pytest.raises(ValueError, match=r"`devices_per_proc` must be a positive integer, got devices_per_proc=0"):
        launch(str(script), [], nproc_per_node=2, devices_per_proc=0)
