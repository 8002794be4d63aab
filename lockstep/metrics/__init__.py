"""Exact stateful metrics: states declare their cross-replica reduction; values are never averaged."""

from ._accuracy import Accuracy as Accuracy
from ._accuracy import BinaryAccuracy as BinaryAccuracy
from ._accuracy import CategoricalAccuracy as CategoricalAccuracy
from ._accuracy import SparseCategoricalAccuracy as SparseCategoricalAccuracy
from ._accuracy import SparseTopKCategoricalAccuracy as SparseTopKCategoricalAccuracy
from ._accuracy import TopKCategoricalAccuracy as TopKCategoricalAccuracy
from ._base import Metric as Metric
from ._base import divide_no_nan as divide_no_nan
from ._base import synced_result as synced_result
from ._collection import MetricCollection as MetricCollection
from ._confusion import AUC as AUC
from ._confusion import Precision as Precision
from ._confusion import Recall as Recall
from ._confusion_matrix import ConfusionMatrix as ConfusionMatrix
from ._fbeta import F1Score as F1Score
from ._fbeta import FBetaScore as FBetaScore
from ._keras import OWN_UPDATE as OWN_UPDATE
from ._keras import KerasMetric as KerasMetric
from ._keras import own_update as own_update
from ._keras import is_reset as is_reset
from ._keras import read_from_keras as read_from_keras
from ._keras import reset_keras as reset_keras
from ._keras import write_to_keras as write_to_keras
from ._reduction import Max as Max
from ._reduction import Mean as Mean
from ._reduction import MeanMetricWrapper as MeanMetricWrapper
from ._reduction import Min as Min
from ._reduction import Sum as Sum
from ._registry import get as get
from ._regression import MeanAbsoluteError as MeanAbsoluteError
from ._regression import MeanSquaredError as MeanSquaredError
from ._regression import R2Score as R2Score
from ._regression import RootMeanSquaredError as RootMeanSquaredError

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "ConfusionMatrix",
    "F1Score",
    "FBetaScore",
    "KerasMetric",
    "Max",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "MetricCollection",
    "Min",
    "Precision",
    "R2Score",
    "Recall",
    "RootMeanSquaredError",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "Sum",
    "TopKCategoricalAccuracy",
    "divide_no_nan",
    "get",
    "synced_result",
    "is_reset",
    "read_from_keras",
    "reset_keras",
    "write_to_keras",
]
