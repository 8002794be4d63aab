"""`CallbackList`: every callback's hooks called in order."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..cluster import agree_on, any_worker
from ._callback import HOOKS, Callback
from ._progbar import ProgbarLogger
from ._trainer_view import TrainerView


#: the hooks of training whose time `seconds` counts (validation's and prediction's are not)
TIMED = frozenset({"on_epoch_begin", "on_epoch_end", "on_train_batch_begin", "on_train_batch_end"})
#: callbacks whose time is checkpoint time (lockstep's or Keras' of these names)
CHECKPOINTERS = frozenset({"BackupAndRestore", "ModelCheckpoint"})


class CallbackList:
    """Calls every hook on every callback, in order (callbacks marked `runs_last`, the backups, last).

    `reads[hook]` says, alike on every worker, whether anything on any worker reads the batch logs
    at `hook` (the workers' logs are a collective, which all of them join)."""

    def __init__(self, callbacks: Iterable[Callback], trainer: TrainerView, params: dict[str, Any] | None = None):
        callbacks = list(callbacks)
        # the progress bar is worker 0's alone: `verbose` stands for it on every worker
        given = [cb for cb in callbacks if not isinstance(cb, ProgbarLogger)]
        wrong = next((cb for cb in callbacks if not isinstance(cb, Callback)), None)
        agreed = any_worker("the callbacks' reading of the batch logs", {  # a progress bar on worker 0 alone
            **{hook: reads_batch_logs(given, hook, (params or {}).get("verbose", 0))
               for hook in ("on_train_batch_end", "on_test_batch_end")},
            **{f"{loop}ing": any(overrides(cb, f"on_{loop}_{at}") for cb in given
                                 for at in ("begin", "batch_begin", "batch_end")) for loop in ("test", "predict")},
            "stops": any(may_stop_in_batches(cb) and overrides(cb, hook) for cb in given
                         for hook in ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end")),
            "wrong": wrong is not None})
        if agreed["wrong"]:  # raised on every worker, none left waiting at the next collective
            raise TypeError("`callbacks` must hold lockstep callback objects (lockstep.Trainer takes Keras callbacks "
                            "too), got " + (type(wrong).__name__ if wrong is not None else
                                            "one that is not on another worker of the job (it names it)") + ".")
        self.reads = {hook: agreed[hook] for hook in ("on_train_batch_end", "on_test_batch_end")}
        #: whether a callback runs at the start or in the batches of `evaluate` ("testing") / `predict`
        #: ("predicting"), where it may set `stop_evaluating` / `stop_predicting` (on every worker alike)
        self.in_batches = {loop: agreed[loop] for loop in ("testing", "predicting")}
        #: whether a callback on some worker may set `stop_training` before an epoch's end (see
        #: `Callback.stops_in_batches`): `fit` then agrees on it after every call of steps
        self.stops_in_batches = agreed["stops"]
        agree_on("the callbacks that decide (stop, restore the best weights, set the learning rate)",
                 lambda: decision_settings(given))
        self.callbacks = list(callbacks)
        #: whether a user's callback runs, which may change the Keras metric objects (`RunningMetrics`)
        self.watches = any(reads_metrics(cb) for cb in self.callbacks)
        # those that back up the training state last, so the backup holds what the others did at that step
        self.callbacks.sort(key=lambda cb: bool(getattr(cb, "runs_last", False)))
        self.seconds: dict[int, float] = {}  # each callback's time in the training hooks (`TIMED`), by id
        self.checkpointers = {id(cb) for cb in self.callbacks if type(getattr(cb, "keras_callback", cb)).__name__
                              in CHECKPOINTERS}
        for cb in self.callbacks:
            cb.set_trainer(trainer)
            if params is not None:
                cb.set_params(params)

    def __getattr__(self, name: str) -> Any:
        if name not in HOOKS:
            raise AttributeError(name)
        # the hooks some callback overrides, bound once (a hook runs every step: keep it cheap)
        bound = [(id(cb), getattr(cb, name)) for cb in self.callbacks
                 if getattr(type(cb), name) is not getattr(Callback, name) or name in vars(cb)]
        seconds = self.seconds

        def call(*args: Any, **kwargs: Any) -> None:
            for _, hook in bound:
                hook(*args, **kwargs)

        def timed(*args: Any, **kwargs: Any) -> None:  # (`Goodput` reads where the training time went)
            for key, hook in bound:
                start = time.perf_counter()
                hook(*args, **kwargs)
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
        if name in TIMED:
            call = timed
        setattr(self, name, call)  # later lookups find the attribute and skip __getattr__
        return call


#: callbacks (Keras' or lockstep's, by name) whose settings decide for the training: every worker gives the same
DECIDERS = ("EarlyStopping", "ReduceLROnPlateau", "TerminateOnNaN", "LearningRateScheduler")
_SETTINGS = ("monitor", "min_delta", "patience", "mode", "baseline", "restore_best_weights", "start_from_epoch",
             "factor", "cooldown", "min_lr", "check_every_batch")


def decision_settings(callbacks: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """The settings of the callbacks among `callbacks` that decide for the training (`DECIDERS`),
    by name and number: what every worker of a job must give alike (a callback that restores the
    best weights on one worker alone would leave the others waiting in a collective).

    >>> import lockstep as ls
    >>> decision_settings([ls.callbacks.EarlyStopping(patience=2), ls.callbacks.History()])["EarlyStopping 1"]["patience"]
    2
    """
    out: dict[str, dict[str, Any]] = {}
    for cb in callbacks:
        inner = getattr(cb, "keras_callback", cb)
        name = type(inner).__name__
        if name in DECIDERS:
            settings = {a: getattr(inner, a) for a in _SETTINGS if hasattr(inner, a)}
            out[f"{name} {sum(k.split()[0] == name for k in out) + 1}"] = {
                a: v.item() if isinstance(v, np.generic) else v for a, v in settings.items()
                if isinstance(v, (str, int, float, bool, np.generic))}
    return out


def may_stop_in_batches(callback: Any) -> bool:
    """Whether `callback` may set `stop_training` before an epoch's end: any but lockstep's own that
    say they do not (`Callback.stops_in_batches`; a user's subclass of one may).

    >>> import lockstep as ls
    >>> TimeLimit = type("TimeLimit", (ls.callbacks.History,), {"__module__": "my_callbacks"})  # a user's
    >>> may_stop_in_batches(ls.callbacks.History()), may_stop_in_batches(TimeLimit())
    (False, True)
    """
    return getattr(callback, "stops_in_batches", True) or not type(callback).__module__.startswith("lockstep.")


def overrides(callback: Callback, hook: str) -> bool:
    """Whether `callback` overrides `hook`: in its class, or on the object itself.

    >>> import lockstep as ls
    >>> overrides(ls.callbacks.EarlyStopping(), "on_epoch_end"), overrides(ls.callbacks.EarlyStopping(), "on_train_batch_end")
    (True, False)
    """
    return hook in getattr(callback, "__dict__", {}) or getattr(type(callback), hook, None) is not getattr(Callback, hook)


def reads_batch_logs(callbacks: Iterable[Any], hook: str, verbose: Any = 0) -> bool:
    """Whether a progress bar (`verbose` 1) or any of `callbacks` reads the logs at `hook` (or,
    one that may read the metric objects, those of the batch before at its beginning).

    >>> import lockstep as ls
    >>> reads_batch_logs([ls.callbacks.EarlyStopping()], "on_train_batch_end"), reads_batch_logs([], "on_train_batch_end", 1)
    (False, True)
    """
    begin = hook.replace("_end", "_begin")  # a user's callback may read the metric objects there (`reads_metrics`)
    return (verbose in (1, "auto") and hook == "on_train_batch_end") or any(
        overrides(cb, hook) or (reads_metrics(cb) and overrides(cb, begin)) for cb in callbacks)


def reads_metrics(callback: Any) -> bool:
    """Whether `callback` may read the running loss and metrics in any hook (`get_metrics_result`,
    the model's metric objects): a user's may, lockstep's own do not (a Keras callback's wrapper says).

    >>> import lockstep as ls
    >>> Running = type("Running", (ls.callbacks.Callback,), {"__module__": "my_callbacks"})  # a user's
    >>> reads_metrics(ls.callbacks.History()), reads_metrics(Running())
    (False, True)
    """
    return getattr(callback, "reads_metrics", not type(callback).__module__.startswith("lockstep."))
