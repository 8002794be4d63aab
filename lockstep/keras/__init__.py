"""Keras inside lockstep: a Keras 3 model as lockstep drives it (`KerasModel`, `_model`: its
`stateless_call`; its layers made exact inside a replica, `_layers`: random draws as one
device's, BatchNorm's global moments, activity regularisers and `add_loss` terms, and refusals
of what a replica cannot do as one device; `memory_estimate`), what `model.compile` gave it
(`_compiled`), a Keras optimizer object and Keras callbacks as that Trainer runs them (`_optimizer`,
`_callbacks`), the `Trainer` that drives Keras models (`_trainer`: `lockstep.Trainer`; its `.keras`
files, `_model_files`), and
Keras' own face: Keras' distribution in a strategy's scope (`_distribution`), Keras' `model.fit`
/ `evaluate` / `predict` run by that Trainer (`_fit`), and Keras metrics updated exactly inside
`strategy.run` (`_metrics_in_run`).

Those last three patch Keras once a process: `install` does all three, and `lockstep` calls it
when a strategy or the Trainer is first asked for (before any scope can be entered); `_layers`
wraps Keras' random functions when a replica's step is first traced. This is the part
above every other: it imports the Trainer, the scopes and the metrics, and nothing imports it but
the public faces `lockstep` and `lockstep.experimental`. How the parts below read a Keras metric
(`lockstep.metrics`) or a `PyDataset` (`lockstep.data`) stays with each part's adapter, where
that part tells the kinds of its inputs apart: their own public faces take them without a Trainer.
"""

from __future__ import annotations

import os
import sys

from ._distribution import follow_scopes
from ._fit import install as _route_fit
from ._metrics_in_run import install as _metrics_in_run
from ._model import KerasModel as KerasModel
from ._model import memory_estimate as memory_estimate
from ._trainer import Trainer as Trainer


def install() -> None:
    """Keras follows lockstep's scopes (once a process), when Keras runs on JAX: imported already,
    or asked for by ``KERAS_BACKEND=jax`` (which importing lockstep first selects); a Keras on
    another backend is refused by the strategies themselves."""
    keras = sys.modules.get("keras")
    if keras is None and os.environ.get("KERAS_BACKEND") == "jax":
        import keras
    if keras is None or keras.backend.backend() != "jax":
        return
    follow_scopes(keras)
    _route_fit(keras)
    _metrics_in_run(keras)
    keras.lockstep_follows_scopes = True  # what a scope checks (`lockstep.distribute`: it cannot import this)


__all__ = ["install", "KerasModel", "memory_estimate", "Trainer"]
