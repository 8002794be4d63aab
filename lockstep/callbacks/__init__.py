"""Callbacks with Keras' hook and argument names; every decision comes from global values."""

from .._exit_codes import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from ._backup_and_restore import BackupAndRestore as BackupAndRestore
from ._callback import HOOKS as HOOKS
from ._callback import Callback as Callback
from ._callback import is_chief as is_chief
from ._callback_list import CallbackList as CallbackList
from ._csv_logger import CSVLogger as CSVLogger
from ._early_stopping import EarlyStopping as EarlyStopping
from ._early_stopping import EarlyStoppingState as EarlyStoppingState
from ._goodput import Goodput as Goodput
from ._history import History as History
from ._learning_rate_scheduler import LearningRateScheduler as LearningRateScheduler
from ._model_checkpoint import ModelCheckpoint as ModelCheckpoint
from ._monitor import MonitorCallback as MonitorCallback
from ._progbar import ProgbarLogger as ProgbarLogger
from ._progbar import format_logs as format_logs
from ._reduce_lr_on_plateau import ReduceLROnPlateau as ReduceLROnPlateau
from ._tensorboard import TensorBoard as TensorBoard
from ._terminate_on_nan import TerminateOnNaN as TerminateOnNaN
from ._trainer_view import TrainerView as TrainerView

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "EarlyStoppingState",
    "Goodput",
    "History",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "MonitorCallback",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
    "format_logs",
    "is_chief",
]
