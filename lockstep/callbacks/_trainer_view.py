"""`TrainerView`: what callbacks may use of the trainer that runs them (lockstep's `Trainer` is
one). Callbacks depend on this protocol, not on the training package, which builds on them.
"""

from __future__ import annotations

from typing import Any, Protocol


class TrainerView(Protocol):
    """The trainer as callbacks see it: its model, decisions, weights, state and files."""

    model: Any
    strategy: Any
    stop_training: bool
    stop_evaluating: bool  # set in a batch of `evaluate` (or of fit's validation): it ends there, as in Keras
    stop_predicting: bool
    learning_rate: float
    last_logs: dict[str, Any] | None  # the loss and metrics of the last epoch or evaluation ended
    steps_per_execution: int  # the batches (optimizer steps) of one call: the batch hooks are called once a call

    @property
    def global_step(self) -> int: ...

    @property
    def optimizer_iterations(self) -> int:
        """The updates the optimizer applied, as Keras' `optimizer.iterations` counts them."""

    @property
    def train_state(self) -> Any:
        """The training state (a `TrainState`): `to_arrays()` gives its named arrays and JSON."""

    def current_state(self) -> Any:
        """`train_state`, its arrays not copied: the next step takes them over."""

    def shared_train_state(self, copy: bool = True) -> Any:
        """`train_state` with every worker's data position (a collective: every worker calls it);
        `copy=False`: not copied, as `current_state`."""

    def restore(self, state: Any) -> None: ...
    def get_metric(self, name: str) -> Any: ...
    def sync_model(self) -> None: ...
    def keras_variables_current(self) -> Any:
        """A context in which the Keras model's variables hold the current weights, and what is
        assigned to them is taken into the training state."""
    def keras_metrics_current(self) -> None:
        """The Keras metric objects given the states of the loop in progress as of its last batch."""
    def keras_metrics_taken(self) -> None:
        """After a user's hook: what callbacks changed in the Keras metric objects since a sync is the
        loop's at once."""
    def keras_metrics_synced(self) -> None:
        """A callback read the model (Keras' state sync): what callbacks assign to the Keras metric
        objects from then on is what the loop goes on from."""
    def metrics_result(self) -> dict[str, Any] | None:
        """Keras' `get_metrics_result` in a loop in progress; None outside a loop."""
    def reset_metrics(self) -> None:
        """Keras' `reset_metrics`: in a loop in progress, its metrics start again from its next step."""
    def get_weights(self) -> Any: ...
    def set_weights(self, weights: Any) -> None: ...
    def save(self, path: str, epoch: int | None = None, writer: Any = None) -> None: ...
    def save_weights(self, path: str, writer: Any = None) -> None: ...
    def fit_counters(self) -> dict[str, Any]:
        """Rows trained, seconds waiting for data and in each callback (`Goodput`)."""
    def step_cost(self) -> dict[str, Any] | None:
        """One step's FLOPs on one device and the device's kind (`Goodput`)."""
