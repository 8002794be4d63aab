"""Training: `Trainer`, `TrainState`, the model adapters' interface (a `FunctionalModel`'s; a Keras
model's is `lockstep.keras`'s) and the compiled-step factories."""

from ..data import DataPosition as DataPosition
from ._inputs import Validation as Validation
from ._inputs import class_weighted as class_weighted
from ._inputs import is_arrays as is_arrays
from ._inputs import to_batches as to_batches
from ._model import FunctionalModel as FunctionalModel
from ._optimizers import get_optimizer as get_optimizer
from ._model import checked_batch_statistics as checked_batch_statistics
from ._optimizers import Optimizer as Optimizer
from ._outputs import Outputs as Outputs
from ._outputs import keras_metric_names as keras_metric_names
from ._outputs import loss_weight as loss_weight
from ._outputs import settings as output_settings
from ._settings import DEFAULT_LOSS as DEFAULT_LOSS
from ._settings import DEFAULT_OPTIMIZER as DEFAULT_OPTIMIZER
from ._settings import ModelSettings as ModelSettings
from ._settings import checked_steps_per_execution as checked_steps_per_execution
from ._state_names import StateNames as StateNames
from ._steps import LAYER_OUTPUT as LAYER_OUTPUT
from ._steps import make_eval_step as make_eval_step
from ._steps import make_predict_step as make_predict_step
from ._steps import make_gradient_step as make_gradient_step
from ._train_state import LoopRecord as LoopRecord
from ._train_state import TrainState as TrainState
from ._train_state import flatten_train_state as flatten_train_state
from ._train_state import unflatten_train_state as unflatten_train_state
from ._trainer import Trainer as Trainer

__all__ = ["DataPosition", "FunctionalModel", "LoopRecord", "Optimizer", "StateNames", "TrainState", "Trainer", "flatten_train_state", "get_optimizer", "make_eval_step",
           "make_gradient_step", "make_predict_step", "unflatten_train_state"]
