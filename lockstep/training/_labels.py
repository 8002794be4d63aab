"""Labels checked on the host against a named classification loss, before they reach a step.

On an accelerator an out-of-range class index does not fail: the loss quietly takes some other
number (or NaN), and float labels are truncated to integers. TensorFlow raises on the first
two; lockstep checks the labels once per array input and per batch for iterables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..data import DataAdapter
from ._steps import unpack


def label_kind(loss: Any) -> str | None:
    """``"sparse"``, ``"categorical"`` or None (no check) for a `Trainer`'s `loss` argument.

    >>> label_kind("sparse_categorical_crossentropy_from_logits"), label_kind("mse")
    ('sparse', None)
    """
    if getattr(loss, "ignore_class", None) is not None or (getattr(loss, "_fn_kwargs", None) or {}).get(
            "ignore_class") is not None:  # a label outside the classes may be the one ignored (-1, 255), as Keras takes it
        return None
    name = loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(loss, "__name__", "")
    name = str(name).lower().removesuffix("_from_logits")
    if name.startswith("sparse_categorical") or name.startswith("sparse_top"):
        return "sparse"
    if name.startswith("categorical_crossentropy") or name == "categorical_focal_crossentropy":
        return "categorical"
    return None


def check_labels(kind: str, y: Any, num_classes: int, arg: str = "y", where: str = "",
                 label_shape: tuple[int, ...] | None = None) -> None:
    """Raises `ValueError` naming `arg` when labels `y` cannot be what a `kind` loss over
    `num_classes` classes expects (`where`: which batch, for the message); `label_shape`: the
    shape of one sample's integer labels, the predictions' up until their last dimension.

    >>> check_labels("sparse", np.array([0, 2, 1]), num_classes=3)
    >>> check_labels("sparse", np.array([0, 3]), num_classes=3)
    Traceback (most recent call last):
    ...
    ValueError: `y` holds label 3 (at index 1), outside the 3 classes [0, 3) the model predicts. ...
    """
    y = np.asarray(y)
    if kind == "sparse":
        if num_classes > 1 and y.ndim >= 2 and y.shape[-1] == num_classes:
            raise ValueError(
                f"`{arg}` looks one-hot (shape {y.shape}{where}) but the loss takes integer class labels: use "
                "'categorical_crossentropy', or pass `y.argmax(-1)`.")
        rank = None if label_shape is None else len(label_shape)  # lengths may vary by batch (sequences)
        if rank is not None and y.ndim and not (y.ndim - 1 == rank or (y.ndim - 1 == rank + 1 and y.shape[-1] == 1)):
            want = f"(batch, {', '.join(map(str, label_shape))})" if label_shape else "(batch,)"
            raise ValueError(
                f"`{arg}` has shape {y.shape}{where}, but the model predicts {num_classes} classes for each label of "
                f"shape {label_shape}: a sparse loss takes integer labels of shape {want}, or with a trailing 1 (Keras: "
                "`target` and `output` must have the same shape up until the last dimension).")
        if y.size == 0:
            return
        if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
            if not np.issubdtype(y.dtype, np.floating):
                raise ValueError(f"`{arg}` must hold integer class labels, got dtype {y.dtype}.")
            frac = np.flatnonzero(y.reshape(-1) != np.round(y.reshape(-1)))
            if frac.size:
                raise ValueError(
                    f"`{arg}` holds float label {y.reshape(-1)[frac[0]]} (at index {frac[0]}{where}), but the loss takes "
                    "integer class labels (it would be truncated): pass integer labels, or use "
                    "'categorical_crossentropy' for soft labels.")
        flat = y.reshape(-1)
        bad = np.flatnonzero((flat < 0) | (flat >= num_classes))
        if bad.size:
            raise ValueError(
                f"`{arg}` holds label {flat[bad[0]]:g} (at index {bad[0]}{where}), outside the {num_classes} classes "
                f"[0, {num_classes}) the model predicts. The loss would not fail: it would silently take another "
                "number. Check the labels, or the model's output size.")
    elif kind == "categorical" and num_classes > 1 and (y.ndim < 2 or y.shape[-1] != num_classes):
        raise ValueError(
            f"`{arg}` has shape {y.shape}{where} but a categorical loss over {num_classes} classes takes one-hot labels "
            f"of shape (..., {num_classes}): use 'sparse_categorical_crossentropy' for integer labels, or "
            "one-hot encode them.")


class LabelCheck:
    """What a `Trainer` checks labels against: its loss's kind, and the model's number of classes
    (set by `set_classes` once the model is built); for a loss per output (`_outputs.OutputLosses`),
    each output's labels against its own loss."""

    def __init__(self, loss: Any):
        self._outputs = getattr(loss, "outputs", None)
        per_output = getattr(loss, "losses", None) if self._outputs is not None else None
        kinds = {k: label_kind(fn) for k, fn in per_output.items()} if per_output is not None else {"": label_kind(loss)}
        self._kinds = {k: kind for k, kind in kinds.items() if kind is not None}
        self._classes: dict[str, int] = {}
        self._rows: dict[str, tuple[int, ...] | None] = {}  # one sample's label shape, by output

    @property
    def kind(self) -> str | None:
        """The kind of the (single) loss, or ``"per_output"``; None when nothing is checked."""
        if not self._kinds:
            return None
        return self._kinds.get("", "per_output")

    @property
    def needs_classes(self) -> bool:
        return bool(self._kinds) and not self._classes

    def set_classes(self, pred_shape: Any) -> None:
        """The number of classes of each checked output, from the model's output shape(s)."""
        shapes = {"": pred_shape} if self._outputs is None else self._outputs.named(pred_shape, "the model's outputs")
        self._classes = {k: (shapes[k][-1] if shapes[k] else 1) for k in self._kinds}
        self._rows = {k: tuple(shapes[k][1:-1]) if len(shapes[k]) >= 2 else None for k in self._kinds}

    def check(self, y: Any, arg: str, where: str = "") -> None:
        """Raises `ValueError` naming `arg` (and the output) when labels `y` cannot be what the loss takes."""
        if self._outputs is None:
            check_labels(self._kinds[""], y, self._classes[""], arg, where, self._rows[""])
            return
        named = self._outputs.named(y, arg)
        for name, kind in self._kinds.items():
            if name in named:
                check_labels(kind, named[name], self._classes[name], f"{arg}['{name}']", where, self._rows[name])


def checked(data: DataAdapter, labels: LabelCheck, y: Any, arg: str,
            inputs: Callable[[Any, str], None] | None = None) -> DataAdapter:
    """`data` whose labels are checked: all at once when they are in memory (`y`, or arrays'),
    else batch by batch as they pass through the host. `inputs(x, where)` checks the inputs of
    batches that pass (arrays' samples all have the first's shape: it is checked when building)."""
    label_check = None
    if labels.kind is not None and not labels.needs_classes:
        label_check = functools.partial(labels.check, arg=arg)
    if not data.host_labels:  # read per worker: labels not seen whole on the host
        return data
    whole = data.whole()
    if y is not None or whole is not None:
        y = y if y is not None else unpack(whole)[1]
        if label_check is not None and y is not None:
            label_check(y)
        return data
    if label_check is None and inputs is None:
        return data

    def check(batch: Any, i: int) -> None:
        x, batch_y, _ = unpack(batch)
        if inputs is not None:
            inputs(x, f" (batch {i + 1})")
        if label_check is not None and batch_y is not None:
            label_check(batch_y, where=f" of batch {i + 1}")
    return data.with_check(check, label_check is not None)
