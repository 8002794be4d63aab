"""`keras.applications` models (weights=None, 32x32 inputs) on 4 replicas against 1 device.

The first step's loss (the forward pass, BatchNorm on the global batch included) equals one
device's within float32 tolerance (1e-4 relative; per-replica statistics miss it by 10-25%).
The weights after an epoch cannot be held to that: at 32x32 inputs the last blocks see 1x1
feature maps, where BatchNorm channels that are nearly constant
over the batch turn float32 rounding into ReLU branch flips with gradients of 1/sqrt(epsilon).
On one device, merely permuting the rows inside each batch moves the epoch's weights as much
as the update itself (measured: MobileNetV2 1.22x, ResNet50 0.85x the update's norm). So the
weights on 4 replicas are held to that yardstick, measured in the same test; per-replica batch
statistics miss it by far (MobileNetV2 220x the update, ResNet50 NaN).
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import optax
import pytest

import lockstep as ls
from launching import CHILD_XLA_FLAGS

N, BATCH = 14, 8  # the last batch has 6 rows: on 4 replicas 2, 2, 2 and one replica of padding only


class _FirstLoss(ls.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.value = float(logs["loss"])


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 32, 32, 3)).astype(np.float32), rng.integers(0, 4, size=N).astype(np.int32)


def _build(name):
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=4)
    for layer in model.layers:  # EfficientNet's dropout and stochastic depth: per replica by design
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def _trainer(name, replicas):
    return ls.Trainer(_build(name), optimizer=optax.sgd(1e-3), loss="sparse_categorical_crossentropy",
                      strategy=ls.MirroredStrategy(replicas))


def _fit(t, w0, x, y):
    """One epoch from weights `w0` (plain SGD: no optimizer state to reset), reusing `t`'s compiled step."""
    first = _FirstLoss()
    t.set_weights(w0)
    history = t.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[first])
    return t.get_weights(), first.value, history.history["loss"][0]


@pytest.mark.full_suite  # 60 s and more a model: make test-full (make test keeps under CI's 15 minutes)
@pytest.mark.parametrize("name", ["ResNet50", "MobileNetV2", "EfficientNetB0"])
def test_one_epoch_on_4_replicas_against_1_device(name):
    x, y = _data()
    one = _trainer(name, 1)
    w0 = one.get_weights()
    w1, first1, _ = _fit(one, w0, x, y)
    w4, first4, loss4 = _fit(_trainer(name, 4), w0, x, y)
    assert np.isfinite(loss4) and all(np.isfinite(w).all() for w in w4)
    # the first step: float32-exact (ResNet50's 50 layers: permuting rows on one device moves it 1.8e-5)
    np.testing.assert_allclose(first4, first1, rtol=1e-4)

    order = np.concatenate([i + np.random.default_rng(0).permutation(min(BATCH, N - i)) for i in range(0, N, BATCH)])
    wp, _, _ = _fit(one, w0, x[order], y[order])

    def distance(a, b):  # relative to the epoch's update on one device
        return float(np.sqrt(sum(np.sum((p - q) ** 2) for p, q in zip(a, b)) /
                             sum(np.sum((p - q) ** 2) for p, q in zip(w1, w0))))

    rounding = distance(wp, w1)  # what the order of float32 sums alone does on one device
    assert distance(w4, w1) <= 2 * rounding + 1e-5, (name, distance(w4, w1), rounding)


# --- against a float64 truth ----------------------------------------------------------------------

#: Keras' own `fit` in float64 in a fresh process. A float64 Keras run needs all three settings:
#: JAX_ENABLE_X64 before JAX is imported, a float64 dtype policy, and Keras' `result_type` left
#: wide (it maps float64 to float32, so BatchNormalization would compute in float32).
TRUTH = textwrap.dedent("""
    import os, sys
    os.environ["JAX_ENABLE_X64"] = "1"
    os.environ["KERAS_BACKEND"] = "jax"
    import numpy as np
    import keras
    from keras.src.backend.common import dtypes
    dtypes.BIT64_TO_BIT32_DTYPE.clear()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    name, path = sys.argv[1], sys.argv[2]
    saved = np.load(path)
    x, y = saved["x"].astype(np.float64), saved["y"]
    w0 = [saved[f"w{i}"].astype(np.float64) for i in range(int(saved["count"]))]
    model = getattr(keras.applications, name)(weights=None, input_shape=x.shape[1:], classes=int(saved["classes"]))
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    assert model.get_layer(index=-1).dtype_policy.name == "float64"
    model.set_weights(w0)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=int(saved["batch"]), epochs=1, shuffle=False, verbose=0)
    np.savez(path + ".truth.npz", *[np.asarray(w) for w in model.get_weights()])
""")


def _float64_truth(name, w0, x, y, tmp_path):
    path = str(tmp_path / "start.npz")
    np.savez(path, x=x, y=y, count=len(w0), classes=4, batch=BATCH, **{f"w{i}": w for i, w in enumerate(w0)})
    proc = subprocess.run([sys.executable, "-c", TRUTH, name, path], capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    truth = np.load(path + ".truth.npz")
    return [truth[f"arr_{i}"] for i in range(len(w0))]


@pytest.mark.full_suite
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", ["DenseNet121", "ResNet50", "MobileNetV2", "EfficientNetB0"])
def test_one_epoch_on_1_2_and_4_replicas_is_as_near_a_float64_truth_as_one_device(name, tmp_path):
    """13 samples, batch 8: one full batch and one of 5 rows (2, 2, 1 and 0 real rows on 4 replicas)."""
    x, y = _data()
    x, y = x[:13], y[:13]
    one = _trainer(name, 1)
    w0 = one.get_weights()
    truth = _float64_truth(name, [np.asarray(w) for w in w0], x, y, tmp_path)
    update = [t - np.asarray(w, np.float64) for t, w in zip(truth, w0)]
    norm = np.sqrt(sum(np.sum(u ** 2) for u in update))

    def distance(weights):  # || dW - dW_truth || / || dW_truth ||
        return float(np.sqrt(sum(np.sum((np.asarray(w, np.float64) - t) ** 2) for w, t in zip(weights, truth))) / norm)

    got = {1: distance(_fit(one, w0, x, y)[0])}
    for replicas in (2, 4):
        got[replicas] = distance(_fit(_trainer(name, replicas), w0, x, y)[0])
    print(f"\n{name}: distance from the float64 truth {got}")
    assert got[2] <= 10 * got[1] and got[4] <= 10 * got[1], (name, got)
