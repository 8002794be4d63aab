"""`keras.applications.ResNet50` under `MirroredStrategy`: the seed article's third example.

ResNet50 (weights=None) on scikit-learn's handwritten digits, scaled up to 32x32 RGB, trained
for an epoch on 4 simulated CPU devices. Its 53 BatchNormalization layers take their batch
statistics over the whole global batch, so the first step's loss is the loss Keras itself
computes on one device for that batch; afterwards, `evaluate` on 4 replicas equals `evaluate`
on 1 with the same weights.

    python examples/resnet_mirrored.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import lockstep as ls  # noqa: E402

ls.simulate_cpu_devices(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

N, BATCH = 90, 16  # 6 steps, the last of 10 rows


class FirstLoss(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.value = float(logs["loss"])


def digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    images = np.kron(x[:N].reshape(N, 8, 8) / 16.0, np.ones((4, 4)))  # 8x8 -> 32x32
    return np.repeat(images[..., None], 3, axis=-1).astype(np.float32), y[:N].astype(np.int32)


def main() -> int:
    x, y = digits()
    strategy = ls.MirroredStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():  # the seed's code as written: build and compile in the scope, then model.fit
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # what Keras computes on one device for the first batch, in training mode (batch statistics)
    logits, _ = model.stateless_call(model.trainable_variables, model.non_trainable_variables, x[:BATCH],
                                     training=True)
    keras_first = float(np.mean(keras.losses.sparse_categorical_crossentropy(y[:BATCH], logits)))

    first = FirstLoss()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=2, callbacks=[first])
    on_four = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    on_one = ls.Trainer(model, strategy=ls.MirroredStrategy(1)).evaluate(x, y, batch_size=BATCH)  # the trained weights

    checks = {
        "first step's loss vs Keras on one device": (first.value, keras_first, 1e-4),
        "evaluate loss, 4 replicas vs 1": (on_four["loss"], on_one["loss"], 1e-5),
        "evaluate accuracy, 4 replicas vs 1": (on_four["accuracy"], on_one["accuracy"], 0.0),
    }
    agree = np.isfinite(history.history["loss"][0])
    print(f"\n{strategy.num_replicas_in_sync} replicas        lockstep     reference")
    for name, (got, want, rtol) in checks.items():
        ok = abs(got - want) <= rtol * abs(want)
        agree &= ok
        print(f"  {name:<42} {got:>10.6f} {want:>10.6f}   {'agree' if ok else 'DISAGREE'}")
    print("all checks agree" if agree else "CHECKS DISAGREE")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
