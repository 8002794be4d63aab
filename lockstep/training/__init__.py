"""Training: `Trainer`, `TrainState`, model adapters and the compiled-step factories."""

from ._data_stream import DataPosition as DataPosition
from ._model import FunctionalModel as FunctionalModel
from ._optimizers import get_optimizer as get_optimizer
from ._state import TrainState as TrainState
from ._state_names import StateNames as StateNames
from ._steps import make_eval_step as make_eval_step
from ._steps import make_predict_step as make_predict_step
from ._steps import make_train_step as make_train_step
from ._trainer import Trainer as Trainer

__all__ = ["DataPosition", "FunctionalModel", "StateNames", "TrainState", "Trainer", "get_optimizer", "make_eval_step", "make_predict_step",
           "make_train_step"]
