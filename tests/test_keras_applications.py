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

import keras
import numpy as np
import optax
import pytest

import lockstep as ls

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


@pytest.mark.parametrize("name", ["ResNet50", pytest.param("MobileNetV2", marks=pytest.mark.full_suite),
                                  pytest.param("EfficientNetB0", marks=pytest.mark.full_suite)])
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
