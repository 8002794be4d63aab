"""What the workers of a job compare at the start of each `fit`: the settings that change the
training without changing the description of a compiled program — the epochs, the shuffle and its
seed, the batch size, the validation schedule, the strategy's mesh and sharding (ZeRO stage,
layout rules), the model's variables and a Keras optimizer's configuration (its learning rate).
A worker whose settings differ would mix two trainings, or wait in a collective the others never
join; `lockstep.cluster`'s `agree_on` names the setting and both values instead
(`WorkersDisagreeError`), before the first step.

>>> import lockstep as ls
>>> settings = fit_settings(ls.Trainer(ls.FunctionalModel(lambda k, x: {}, lambda p, x: x)), {"epochs": 3})
>>> settings["epochs"], settings["strategy"]
(3, 'OneDeviceStrategy')
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np


def _plain(value: Any) -> Any:
    """`value` as JSON data (a class weight's keys as strings, NumPy numbers as Python's, NaN as a
    string, an object by its repr without memory addresses, which differ between processes)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return "nan"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def _optimizer_config(optimizer: Any) -> Any:
    try:
        config = optimizer.get_config()  # a learning-rate schedule without get_config raises
    except Exception:  # noqa: BLE001 - then its class stands for it
        return type(optimizer).__name__
    return _plain({k: v for k, v in config.items() if k != "name"})


def fit_settings(trainer: Any, given: dict[str, Any]) -> dict[str, Any]:
    """`given` (fit's arguments, by name) and the trainer's settings, as JSON data."""
    strategy = trainer.strategy
    mesh = strategy.extended.mesh
    out = {name: _plain(value) for name, value in given.items()}
    out["strategy"] = type(strategy).__name__
    out["the mesh"] = {str(a): int(n) for a, n in zip(mesh.axis_names, mesh.devices.shape)}
    out["the sharding (ZeRO stage, layout rules, ...)"] = repr(strategy.extended.sharding)
    out["steps_per_execution"] = trainer.steps_per_execution
    variables = getattr(trainer.model, "variables", None)
    if variables is not None:  # a Keras model: its variables' shapes (their names may be numbered apart)
        out["the model's variables"] = [f"{tuple(v.shape)} {v.dtype}" for v in variables]
    optimizer = getattr(trainer.model, "optimizer", None)
    if hasattr(optimizer, "get_config"):  # a compiled Keras model's: its learning rate, ...
        out["the optimizer's configuration"] = _optimizer_config(optimizer)
    return out
