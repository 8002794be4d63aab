"""Two workers fit a Keras regressor with a user's metrics (test_keras_as_written's data and model); each prints its result."""
import json, os
os.environ["KERAS_BACKEND"] = "jax"
import lockstep as ls
strategy = ls.MultiWorkerMirroredStrategy()
import jax, keras, numpy as np
from test_keras_as_written import RMSE, WeightedMAE, X, Y_VALUE, WEIGHTS, counting_metrics, regressor
with strategy.scope():
    model = regressor([RMSE(), *counting_metrics()], weighted_metrics=[WeightedMAE()], optimizer=keras.optimizers.Adam(0.01))
n = 194  # the last batch of 2 rows: worker 1's two replicas hold no real row
history = ls.Trainer(model).fit(X[:n], Y_VALUE[:n], batch_size=16, epochs=2, shuffle=False, verbose=0,
                                sample_weight=WEIGHTS[:n], validation_data=(X[n:], Y_VALUE[n:])).history
evaluated = model.evaluate(X[:n], Y_VALUE[:n], batch_size=16, verbose=0, return_dict=True)


class StopOnWorker0(keras.callbacks.Callback):  # worker 0 alone asks to end evaluate after batch 2
    def on_test_batch_end(self, batch, logs=None):
        if batch == 2 and jax.process_index() == 0:
            self.model.stop_evaluating = True


stopped = model.evaluate(X[:n], Y_VALUE[:n], batch_size=16, verbose=0, return_dict=True, callbacks=[StopOnWorker0()])
print("RESULT", json.dumps({"history": history, "evaluate": evaluated, "stopped": stopped, "iterations": int(model.optimizer.iterations),
                            "optimizer": [np.asarray(v).tolist() for v in model.optimizer.variables],
                            "weights": [w.tolist() for w in model.get_weights()]}), flush=True)
