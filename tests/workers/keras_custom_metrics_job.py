"""Two workers fit a Keras regressor with a user's metrics (test_keras_as_written's data and model),
fit / evaluate / predict a subclassed model first used on a generator (test_keras_settings'), and
try draws no replica can make as one device (test_keras_layers' MixUp and JaxLayer), and a fit given a non-callback
on worker 1 alone; each prints its result."""
import json, os
os.environ["KERAS_BACKEND"] = "jax"
import lockstep as ls
strategy = ls.MultiWorkerMirroredStrategy()
import jax, keras, numpy as np
from test_keras_as_written import ChangesMetricObjects, ChiefReadsMetrics, RMSE, WeightedMAE, X, Y_VALUE, WEIGHTS, counting_metrics, regressor
with strategy.scope():
    model = regressor([RMSE(), *counting_metrics()], weighted_metrics=[WeightedMAE()], optimizer=keras.optimizers.Adam(0.01))
n = 194  # the last batch of 2 rows: worker 1's two replicas hold no real row
reads = ChiefReadsMetrics()  # worker 0 alone reads the metric objects after each batch
history = ls.Trainer(model).fit(X[:n], Y_VALUE[:n], batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[reads],
                                sample_weight=WEIGHTS[:n], validation_data=(X[n:], Y_VALUE[n:])).history
evaluated = model.evaluate(X[:n], Y_VALUE[:n], batch_size=16, verbose=0, return_dict=True)
with strategy.scope():  # the metric objects changed by every worker's hooks, as Keras code may
    windowed = regressor([RMSE(), *counting_metrics()], weighted_metrics=[WeightedMAE()])
windows = windowed.fit(X[:n], Y_VALUE[:n], batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[ChangesMetricObjects()],
                       sample_weight=WEIGHTS[:n], validation_data=(X[n:], Y_VALUE[n:])).history


class StopOnWorker0(keras.callbacks.Callback):  # worker 0 alone asks to end evaluate after batch 2
    def on_test_batch_end(self, batch, logs=None):
        if batch == 2 and jax.process_index() == 0:
            self.model.stop_evaluating = True


stopped = model.evaluate(X[:n], Y_VALUE[:n], batch_size=16, verbose=0, return_dict=True, callbacks=[StopOnWorker0()])
from test_keras_settings import on_a_generator, subclassed_compiled

with strategy.scope():  # made in the scope, no variables until its first batch (of a generator)
    sub = subclassed_compiled()
generated = {call: on_a_generator(sub, call) for call in ("fit", "evaluate", "predict")}
generated["predict"] = generated["predict"].tolist()
generated["weights"] = [w.tolist() for w in sub.get_weights()]

from test_keras_layers import REFUSED_DRAWS, _labels, _seq

refused = {}
for name in ("MixUp", "JaxLayer drawing with its rng"):  # refused alike on both workers: neither hangs
    with strategy.scope():
        keras.utils.set_random_seed(0)
        drawer = keras.Sequential([keras.Input((6, 3)), *REFUSED_DRAWS[name][0](), keras.layers.Dense(3)])
        drawer.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        drawer.fit(_seq(n=13), _labels(_seq(n=13)), batch_size=4, epochs=1, shuffle=False, verbose=0)
        refused[name] = None
    except ValueError as e:
        refused[name] = str(e)
try:  # worker 1 alone gives fit something that is not a callback: both raise, neither waits for the other
    model.fit(X[:n], Y_VALUE[:n], batch_size=16, epochs=1, verbose=0,
              callbacks=[{"monitor": "loss"}] if jax.process_index() == 1 else [])
    refused["not a callback"] = None
except TypeError as e:
    refused["not a callback"] = str(e)
print("RESULT", json.dumps({"reads": reads.read, "windows": windows, "generated": generated, "refused": refused, "history": history, "evaluate": evaluated, "stopped": stopped, "iterations": int(model.optimizer.iterations),
                            "optimizer": [np.asarray(v).tolist() for v in model.optimizer.variables],
                            "weights": [w.tolist() for w in model.get_weights()]}), flush=True)
