"""Two workers fit a two-input, two-output Keras model (test_keras_multi_output's data and model); each prints its result."""
import json, os
os.environ["KERAS_BACKEND"] = "jax"
import lockstep as ls
strategy = ls.MultiWorkerMirroredStrategy()
from test_keras_multi_output import B, W, XA, XB, Y_CLS, Y_REG, two_headed
with strategy.scope():
    model = two_headed()
n = 58  # the last batch of 2 rows: worker 1's two replicas hold no real row
history = model.fit([XA[:n], XB[:n]], [Y_CLS[:n], Y_REG[:n]], sample_weight=W[:n], batch_size=B, epochs=2,
                    shuffle=False, verbose=0).history
print("RESULT", json.dumps({"history": history, "weights": [w.tolist() for w in model.get_weights()],
                            "evaluate": model.evaluate([XA, XB], [Y_CLS, Y_REG], batch_size=B, verbose=0)}),
      flush=True)
