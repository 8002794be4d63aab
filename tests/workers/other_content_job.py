"""Each worker passes arrays or batches of other content (its own shuffle, labels, validation)."""

import numpy as np

import lockstep as ls
from common import linear_model

s = ls.MultiWorkerMirroredStrategy()
w = s.worker_index
t = ls.Trainer(linear_model(), optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits", strategy=s)
x = np.arange(512, dtype=np.float32).reshape(256, 2)
y = np.arange(256) % 2
order = np.random.default_rng(w).permutation(256)  # each worker its own seed
cases = {
    "shuffled x and y": lambda: t.fit(x[order], y[order], batch_size=32, verbose=0),
    "other y": lambda: t.fit(x, (y + w) % 2, batch_size=32, verbose=0),
    "other validation y": lambda: t.fit(x, y, batch_size=32, verbose=0, validation_data=(x, (y + w) % 2)),
    "evaluate": lambda: t.evaluate(x[order], y[order], batch_size=32, verbose=0),
    "batches": lambda: t.fit([(x[order][:32], y[order][:32])], verbose=0),
}
for case, call in cases.items():
    try:
        call()
        print(f"{case}: accepted", flush=True)
    except ValueError as e:
        print(f"{case}: {e}", flush=True)
t.fit(x, y, batch_size=32, shuffle=True, seed=3, verbose=0)
print("the same arrays everywhere: trained", flush=True)
