"""Early stopping on a distributed validation set: the same epoch on 1 and on 4 replicas.

The validation set (449 samples) splits unevenly: its last batch is short and some replicas
get padding only. lockstep's `val_loss` is the exact whole-set value, so `EarlyStopping` takes
the same decision, at the same epoch, whatever the number of replicas; we check `val_loss`
against NumPy on the restored weights.

    python examples/early_stopping.py
"""

import lockstep as ls

ls.simulate_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_breast_cancer  # noqa: E402


def logistic() -> ls.FunctionalModel:
    return ls.FunctionalModel(
        init=lambda rng, x: {"w": jnp.zeros((x.shape[-1],)), "b": jnp.zeros(())},
        apply=lambda p, x, training=False: jax.nn.sigmoid(x @ p["w"] + p["b"]))


def main() -> int:
    x, y = load_breast_cancer(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    y = y.astype(np.float32)
    x_val, y_val = x[:449], y[:449]
    x_train, y_train = x[449:], y[449:]
    runs = {}
    for replicas in (1, 4):
        trainer = ls.Trainer(logistic(), optimizer="sgd", loss="binary_crossentropy", metrics=["accuracy"],
                             strategy=ls.MirroredStrategy(replicas))
        stop = ls.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=1e-3, restore_best_weights=True)
        history = trainer.fit(x_train, y_train, batch_size=32, epochs=200, validation_data=(x_val, y_val),
                              validation_batch_size=64, verbose=0, callbacks=[stop])
        runs[replicas] = (history, stop, trainer)
        print(f"{replicas} replica(s): stopped after epoch {history.epoch[-1] + 1}, best epoch {stop.best_epoch + 1}, "
              f"best val_loss {stop.best:.6f}")
    (h1, s1, _), (h4, s4, t4) = runs[1], runs[4]
    w = t4.get_weights()
    p = 1 / (1 + np.exp(-(x_val.astype(np.float64) @ w["w"] + w["b"])))
    p = np.clip(p, 1e-7, 1 - 1e-7)
    numpy_val_loss = float(np.mean(-(y_val * np.log(p) + (1 - y_val) * np.log(1 - p))))
    lockstep_val_loss = t4.evaluate(x_val, y_val, batch_size=64)["loss"]
    same_epoch = h1.epoch == h4.epoch and s1.best_epoch == s4.best_epoch
    exact = abs(lockstep_val_loss - numpy_val_loss) <= 1e-5 * numpy_val_loss
    print(f"val_loss of the restored weights: lockstep {lockstep_val_loss:.6f}  numpy {numpy_val_loss:.6f}")
    print("same stopping epoch on 1 and 4 replicas and exact val_loss -> "
          + ("agree" if same_epoch and exact else "DISAGREE"))
    return 0 if same_epoch and exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
