"""A custom training loop written the `tf.distribute` way, on 4 replicas.

Trains a small MLP on scikit-learn's handwritten digits with `MirroredStrategy`, `scope`,
`run`, `reduce` and a distributed dataset, then checks the held-out accuracy that lockstep
reports against NumPy on the same weights.

    python examples/custom_loop.py
"""

import lockstep as ls

ls.simulate_cpu_devices(4)  # before JAX starts: 4 replicas on this CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

GLOBAL_BATCH = 64  # the whole step, all replicas together
EPOCHS = 8


def init_mlp(rng: np.random.Generator, sizes=(64, 128, 10)) -> dict:
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.normal(size=(m, n)) * np.sqrt(2.0 / m)).astype(np.float32)
        params[f"b{i}"] = np.zeros(n, np.float32)
    return params


def mlp(params, x):
    h = jax.nn.relu(x @ params["w0"] + params["b0"])
    return h @ params["w1"] + params["b1"]


def main() -> int:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)

    strategy = ls.MirroredStrategy()
    print(f"replicas in sync: {strategy.num_replicas_in_sync}")
    with strategy.scope():
        params = init_mlp(np.random.default_rng(0))
        optimizer = optax.adam(1e-2)
        opt_state = optimizer.init(params)

    train_ds = strategy.experimental_distribute_dataset(
        ls.data.batches((x_train, y_train), GLOBAL_BATCH, shuffle=True, seed=0))
    test_ds = strategy.experimental_distribute_dataset(ls.data.batches((x_test, y_test), GLOBAL_BATCH))

    def train_step(params, opt_state, batch):
        features, labels = batch

        def loss_fn(p):
            per_example = ls.losses.sparse_categorical_crossentropy(labels, mlp(p, features), from_logits=True)
            return ls.compute_average_loss(per_example), per_example

        (_, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        # grads of replicated params come back summed over replicas: the global gradient
        updates, opt_state = optimizer.update(grads, opt_state, params)
        correct = (jnp.argmax(mlp(params, features), -1) == labels).astype(jnp.float32)
        return optax.apply_updates(params, updates), opt_state, per_example, correct

    def eval_step(params, batch):
        features, labels = batch
        return (jnp.argmax(mlp(params, features), -1) == labels).astype(jnp.float32)

    def accuracy(dataset) -> float:
        correct = 0.0
        for batch in dataset:
            correct += float(strategy.reduce(ls.ReduceOp.SUM, strategy.run(eval_step, args=(params, batch)), axis=0))
        return correct / len(x_test)

    for epoch in range(1, EPOCHS + 1):
        loss_sum = correct_sum = 0.0
        for batch in train_ds:
            params, opt_state, per_example, correct = strategy.run(train_step, args=(params, opt_state, batch))
            # axis=0 sums over the real samples of every replica; padding never counts
            loss_sum += float(strategy.reduce(ls.ReduceOp.SUM, per_example, axis=0))
            correct_sum += float(strategy.reduce(ls.ReduceOp.SUM, correct, axis=0))
        print(f"epoch {epoch}: loss {loss_sum / len(x_train):.4f}  accuracy {correct_sum / len(x_train):.4f}"
              f"  test accuracy {accuracy(test_ds):.4f}")

    lockstep_acc = accuracy(test_ds)
    host = jax.tree.map(np.asarray, params)
    logits = np.maximum(x_test @ host["w0"] + host["b0"], 0) @ host["w1"] + host["b1"]
    numpy_acc = float(np.mean(np.argmax(logits, -1) == y_test))
    agree = lockstep_acc == numpy_acc
    print(f"held-out accuracy: lockstep {lockstep_acc:.6f}  numpy {numpy_acc:.6f}  "
          f"({len(x_test)} samples) -> {'agree' if agree else 'DISAGREE'}")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
