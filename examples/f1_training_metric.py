"""F1 as a training metric: exact on several replicas, where averaging per-replica F1 is wrong.

Trains on scikit-learn's digits with macro F1 as a metric under 4 replicas, then shows, on the
held-out set, three numbers: scikit-learn's F1, lockstep's F1, and the per-replica average that
Horovod's `MetricAverageCallback` or per-replica logs would report.

    python examples/f1_training_metric.py
"""

import lockstep as ls

ls.simulate_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.metrics import f1_score  # noqa: E402


def mlp() -> ls.FunctionalModel:
    def init(rng, x):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (x.shape[-1], 32)) * 0.2, "b1": jnp.zeros(32),
                "w2": jax.random.normal(k2, (32, 10)) * 0.2, "b2": jnp.zeros(10)}
    return ls.FunctionalModel(init, lambda p, x, training=False: jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])


def main() -> int:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, y_train, x_test, y_test = x[:1200], y[:1200], x[1200:], y[1200:]
    strategy = ls.MirroredStrategy(4)
    f1 = ls.metrics.F1Score(average="macro")
    model = mlp()
    trainer = ls.Trainer(model, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                         metrics=[f1], strategy=strategy)
    history = trainer.fit(x_train, y_train, batch_size=64, epochs=12, verbose=0)
    print("training f1_score per epoch:", [round(v, 4) for v in history.history["f1_score"]])

    lockstep_f1 = trainer.evaluate(x_test, y_test, batch_size=len(x_test))["f1_score"]
    sklearn_f1 = f1_score(y_test, trainer.predict(x_test).argmax(1), average="macro")

    # what averaging metric values does: each replica's F1 on its own quarter, then a mean
    batch = next(iter(strategy.experimental_distribute_dataset([(x_test, y_test)])))
    params = trainer.get_weights()

    def per_replica_f1(params, batch):
        xb, yb = batch
        logits = model.apply(params, xb)
        return f1.result_from(f1.update(f1.init(), yb, logits))
    naive = float(np.mean([float(v) for v in strategy.experimental_local_results(
        strategy.run(per_replica_f1, args=(params, batch)))]))
    print(f"held-out macro F1: scikit-learn {sklearn_f1:.6f}  lockstep {lockstep_f1:.6f}  "
          f"average of per-replica F1 {naive:.6f}")
    ok = abs(lockstep_f1 - sklearn_f1) <= 1e-6 and abs(naive - sklearn_f1) > 1e-4
    print("lockstep equals scikit-learn; the per-replica average does not -> " + ("agree" if ok else "DISAGREE"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
