"""Scale a Keras model with a strategy: the main job of `make demo`.

A Keras MLP on scikit-learn's handwritten digits, written as Keras code is (build and compile in
the strategy's scope, `model.fit` with Keras callbacks), trained by lockstep under
`MirroredStrategy` on 4 simulated CPU devices, with a validation split, early stopping that
restores the best weights, a best-only checkpoint, macro F1 as a training metric and a PNG of
the curves. At the end, lockstep's exact held-out metrics are printed next to scikit-learn's on
the same predictions.

    python examples/keras_mirrored.py [output_dir]
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import lockstep as ls  # noqa: E402

ls.simulate_cpu_devices(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.metrics import accuracy_score, f1_score, log_loss  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def main(out_dir: str = "demo_output") -> int:
    os.makedirs(out_dir, exist_ok=True)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)

    strategy = ls.MirroredStrategy()
    print(f"training on {strategy.num_replicas_in_sync} replicas")
    keras.utils.set_random_seed(0)
    with strategy.scope():  # Keras code as written: build and compile in the scope, then model.fit
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy", ls.metrics.F1Score(average="macro")])
    best_path = os.path.join(out_dir, "best.weights.h5")
    history = model.fit(
        x_train, y_train, batch_size=64, epochs=60, validation_split=0.2, verbose=2,
        callbacks=[
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True, verbose=1),
            keras.callbacks.ModelCheckpoint(best_path, monitor="val_loss", save_best_only=True, save_weights_only=True),
        ])
    png = history.plot(os.path.join(out_dir, "curves.png"), keys=["loss", "accuracy", "f1_score"])
    print(f"curves: {png}; best weights: {best_path}")

    results = model.evaluate(x_test, y_test, batch_size=64, verbose=0, return_dict=True)
    probs = model.predict(x_test, batch_size=64, verbose=0)
    assert probs.shape[0] == len(x_test)
    pred = probs.argmax(1)
    reference = {
        "loss": log_loss(y_test, np.clip(probs, 1e-7, 1 - 1e-7), labels=np.arange(10)),
        "accuracy": accuracy_score(y_test, pred),
        "f1_score": f1_score(y_test, pred, average="macro"),
    }
    print(f"\nheld-out ({len(x_test)} samples)   lockstep      scikit-learn")
    agree = True
    for name, ref in reference.items():
        ok = abs(results[name] - ref) <= 1e-5 * max(1.0, abs(ref))
        agree &= ok
        print(f"  {name:<12} {results[name]:>14.6f} {ref:>14.6f}   {'agree' if ok else 'DISAGREE'}")
    print("all metrics agree" if agree else "METRICS DISAGREE")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
