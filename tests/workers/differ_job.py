"""Two workers whose settings differ in one thing at a time (worker 1 the odd one), each case in
turn in the same processes: every case must end in WorkersDisagreeError on both workers, naming
what differs, before a step mixes two trainings; then a fit where only worker 0 shows a progress
bar (verbose=1, a TF habit) trains, fits that a callback of worker 1's alone stops (in a batch, at
an epoch's end), and a diverging fit that Keras' TerminateOnNaN stops. Each worker prints one
RESULT: case -> the error's text (a callback that resets the metrics on worker 1 alone too), and the stopped fits' epochs and steps."""
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()
import keras  # noqa: E402
import numpy as np  # noqa: E402

odd = strategy.worker_index == 1
rng = np.random.default_rng(0)
x, y = rng.normal(size=(40, 4)).astype("float32"), rng.normal(size=(40, 1)).astype("float32")


def model(lr=0.01, on=strategy):
    with on.scope():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="hidden"), keras.layers.Dense(1, name="out")])
        m.compile(keras.optimizers.SGD(lr), "mse")
    return m


def sharded(stage, rules):
    mesh = ls.DeviceMesh((2, 2), ("batch", "model"))  # each worker's 2 devices: one replica, split in 2
    layout = ls.LayoutMap(mesh)
    for key, axes in rules.items():
        layout[key] = axes
    return ls.ShardedStrategy(mesh=mesh, layout_map=layout, batch_dim_name="batch", zero_stage=stage, min_shard_size=1,
                              max_replicated_fraction=1.0)


batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)]
other = list(batches)
other[2] = (x[16:24] + 1, y[16:24])  # worker 1's third batch differs
hidden = {".*hidden/kernel": (None, "model")}


class ResetsOnWorker1(keras.callbacks.Callback):
    """Resets the metrics after batch 1 on worker 1 alone (Keras' `reset_metrics`, a window of them)."""

    def on_train_batch_end(self, batch, logs=None):
        if odd and batch == 1:
            self.model.reset_metrics()


class ResetsAMetricOnWorker1(keras.callbacks.Callback):
    """Resets one metric object after batch 1 on worker 1 alone (taken from the model, as Keras' loops hold it)."""

    def on_train_batch_end(self, batch, logs=None):
        if odd and batch == 1:
            self.model.metrics[0].reset_state()


class ChangesAMetricOnWorker1(keras.callbacks.Callback):
    """On worker 1 alone: resets the loss tracker after the epoch's last batch ("last": no call of
    steps after it), updates it, kept from before the fit, after reading the model ("stale": the
    object held an earlier batch's state), or resets it as an epoch resumed at its end begins."""

    def __init__(self, at, kept=None):
        super().__init__()
        self.at, self.kept = at, kept

    def on_epoch_begin(self, epoch, logs=None):
        if odd and self.at == "resumed":
            self.model.metrics[0].reset_state()

    def on_train_batch_end(self, batch, logs=None):
        if odd and self.at == "last" and batch == 4:
            self.model.metrics[0].reset_state()
        if odd and self.at == "stale" and batch == 1:
            self.model.stop_training = False
            self.kept.update_state(3.0)


class InterruptsAtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise KeyboardInterrupt


def resumed_at_an_epoch_end():
    """A fit backed up after the last batch of epoch 0 and stopped before its end, resumed: its
    epoch 0 has no steps left, so no call of steps follows the reset in `on_epoch_begin`."""
    backup = os.path.join(sys.argv[1], "backup")
    fit = dict(x=x, y=y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    try:
        model().fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), InterruptsAtEpochEnd()])
    except KeyboardInterrupt:
        pass
    model().fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), ChangesAMetricOnWorker1("resumed")])


kept = model()
cases = {
    "epochs": lambda: model().fit(x, y, batch_size=8, epochs=3 if odd else 2, verbose=0),
    "shuffle": lambda: model().fit(x, y, batch_size=8, shuffle=odd, verbose=0),
    "seed": lambda: ls.Trainer(model()).fit(x, y, batch_size=8, seed=int(odd), verbose=0),
    "Trainer seed": lambda: ls.Trainer(model(), seed=int(odd)).fit(x, y, batch_size=8, verbose=0),
    "learning rate": lambda: model(lr=0.02 if odd else 0.01).fit(x, y, batch_size=8, verbose=0),
    "ZeRO stage": lambda: model(on=sharded(3 if odd else 1, hidden)).fit(x, y, batch_size=8, verbose=0),
    "layout rule": lambda: model(on=sharded(1, {**hidden, ".*out/kernel": ("model", None) if odd else (None, None)})
                                 ).fit(x, y, batch_size=8, verbose=0),
    "batches": lambda: model().fit(other if odd else batches, epochs=2, verbose=0),
    "EarlyStopping": lambda: model().fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x[:8], y[:8]),
                                         callbacks=[keras.callbacks.EarlyStopping(patience=1, restore_best_weights=odd)]),
    "reset_metrics": lambda: model().fit(x, y, batch_size=8, verbose=0, callbacks=[ResetsOnWorker1()]),
    "reset_state": lambda: model().fit(x, y, batch_size=8, verbose=0, callbacks=[ResetsAMetricOnWorker1()]),
    "reset_state at the end": lambda: model().fit(x, y, batch_size=8, verbose=0, callbacks=[ChangesAMetricOnWorker1("last")]),
    "stale update": lambda: kept.fit(x, y, batch_size=8, verbose=0, callbacks=[ChangesAMetricOnWorker1("stale", kept.metrics[0])]),
    "reset_state as a resumed epoch ends": resumed_at_an_epoch_end,
}
caught = {}
for name, case in cases.items():
    try:
        case()
        caught[name] = "trained"
    except ls.UsageError as e:  # (WorkersDisagreeError is one)
        caught[name] = str(e)
history = model().fit(x, y, batch_size=8, epochs=2, verbose=0 if odd else 1).history  # worker 0's bar alone


class StopsOnWorker1(keras.callbacks.Callback):
    """Asks to stop at the end of batch 1, or of epoch 0, on worker 1 alone (a callback of its own)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.at == "batch" and odd and batch == 1:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.at == "epoch" and odd and epoch == 0:
            self.model.stop_training = True


stopped = {}
for at in ("batch", "epoch"):  # every worker stops where worker 1 asked
    m = model()
    h = m.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[StopsOnWorker1(at)] if odd else [])
    stopped[at] = [len(h.history["loss"]), int(m.optimizer.iterations)]
m = model(lr=1.0)  # diverges: Keras' TerminateOnNaN stops both at the same batch, and the NaN weights are kept
h = m.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[keras.callbacks.TerminateOnNaN()])
stopped["nan"] = [len(h.history["loss"]), int(m.optimizer.iterations), bool(np.isnan(m.get_weights()[0]).any())]
print("RESULT", json.dumps({"caught": caught, "loss": history["loss"], "stopped": stopped}), flush=True)
