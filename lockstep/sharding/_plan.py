"""Sharded layouts of a model's state: which mesh axes split which dimension of each parameter,
gradient and optimizer-state array, why, and what that costs each device.

Two things split a variable. Layout rules (regular expressions fully matched against its path,
each giving one mesh axis name or None per dimension) lay it over the model axes: tensor
parallelism. The ZeRO stage splits it along the batch axis, on the largest dimension (by default)
that the rules leave whole and the batch axis divides: stage 1 the optimizer state, stage 2 the
gradients too, stage 3 (FSDP) the parameters too, which the step gathers whole for its forward
and backward pass. A variable smaller than `min_shard_size` elements stays whole along the batch
axis, and non-trainable state (batch-norm statistics) never moves off it.

Uneven sizes are padded, never refused. JAX lays an array out only along axes that divide its
dimensions, so a variable that a split does not divide is *stored* padded with zeros at the end
of that dimension up to a multiple of the split (`VariableLayout.stored_shape`); every step cuts
it back to its shape before it computes (`fit_to`), so padding never takes part in a number.
Read out whole (a Keras variable, a backup) it lies as `variable_spec`: its layout without the
splits that do not divide it. ZeRO pads only a variable none of whose free dimensions it divides.

>>> import jax, numpy as np
>>> from jax.sharding import Mesh
>>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("batch", "model"))
>>> plan = ShardingPlan.make(mesh, "batch", {"dense/kernel": np.zeros((16, 32), np.float32),
...                                          "dense/bias": np.zeros((32,), np.float32)},
...                          {".*kernel": (None, "model")}, zero_stage=3, min_shard_size=64)
>>> [(v.path, v.param_spec) for v in plan.variables]
[('dense/kernel', P('batch', 'model')), ('dense/bias', P())]
>>> plan.variables[0].param_bytes_per_device   # 16 * 32 * 4 bytes over 8 devices
256
>>> odd = ShardingPlan.make(mesh, "batch", {"out/kernel": np.zeros((9, 10), np.float32)},
...                         {".*kernel": (None, "model")}, zero_stage=3, min_shard_size=64).variables[0]
>>> odd.param_spec, odd.stored_shape(odd.param_spec), odd.variable_spec   # 9 rows over 2, 10 columns over 4
(P('batch', 'model'), (10, 12), P())
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._errors import UsageError

#: Which dimension ZeRO splits along the batch axis: the largest, the first or the last that it
#: divides (of those it does not divide when it divides none: padded).
SHARD_DIMS = ("largest", "first", "last")


@dataclasses.dataclass(frozen=True)
class VariableLayout:
    """One variable's layout: `axes` (the matched rule's, one mesh axis or None per dimension),
    `zero_dim` (the dimension the batch axis splits for ZeRO, or None: `why_whole` says why), and
    the specs of its parameter (`param_spec`) and optimizer state (`state_spec`)."""

    path: str
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    rule: str | None
    axes: tuple[str | None, ...]
    zero_dim: int | None
    why_whole: str
    param_spec: P
    state_spec: P
    mesh_sizes: tuple[tuple[str, int], ...]

    def bytes_per_device(self, spec: P) -> int:
        """Bytes of this variable (one array of its shape and dtype) that each device holds under `spec`."""
        return shard_bytes(self.shape, self.itemsize, spec, dict(self.mesh_sizes))

    @property
    def param_bytes_per_device(self) -> int:
        return self.bytes_per_device(self.param_spec)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def stored_shape(self, spec: P) -> tuple[int, ...]:
        """The shape an array of this variable is stored in under `spec`: each dimension padded up
        to a multiple of the devices splitting it (its own shape where they divide it)."""
        sizes = dict(self.mesh_sizes)
        return tuple(-(-dim // n) * n for dim, n in zip(self.shape, _splits(spec, len(self.shape), sizes)))

    @property
    def padded(self) -> bool:
        """Whether its parameter or optimizer state is stored padded (a split does not divide it)."""
        return self.stored_shape(self.state_spec) != self.shape or self.stored_shape(self.param_spec) != self.shape

    def even(self, spec: P) -> P:
        """`spec` without the splits that do not divide this variable's dimensions: where an array
        of its own shape can lie."""
        sizes = dict(self.mesh_sizes)
        splits = _splits(spec, len(self.shape), sizes)
        axes = [a if n == 1 or dim % n == 0 else None
                for a, dim, n in zip(tuple(spec) + (None,) * len(self.shape), self.shape, splits)]
        return _with_axis(tuple(axes), None, "")

    @property
    def variable_spec(self) -> P:
        """Where the variable itself lies (a Keras variable, a value read out whole): `param_spec`
        without the splits that do not divide it (see the module doc)."""
        return self.even(self.param_spec)

    @property
    def split(self) -> bool:
        """Whether some axis of more than one device splits its optimizer state (it is not left
        replicated on every device)."""
        return self.bytes_per_device(self.state_spec) < self.nbytes


def _splits(spec: P, ndim: int, sizes: Mapping[str, int]) -> list[int]:
    """How many ways `spec` splits each of `ndim` dimensions on a mesh whose axes have `sizes`."""
    out = []
    for axis in (tuple(spec) + (None,) * ndim)[:ndim]:
        names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        out.append(math.prod(sizes[a] for a in names))
    return out


def fit_to(x: Any, shape: tuple[int, ...]) -> Any:
    """`x` cut, or padded with zeros, at the end of each dimension to `shape`: an array stored
    padded (`VariableLayout.stored_shape`) to its own shape and back. NumPy arrays stay NumPy;
    JAX values (traced ones included) stay JAX.

    >>> fit_to(np.arange(3.0), (4,)).tolist(), fit_to(np.arange(4.0), (3,)).tolist()
    ([0.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0])
    """
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape))]
    widths = [(0, b - a) for a, b in zip(x.shape, shape)]
    if not any(w for _, w in widths):
        return x
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def shard_bytes(shape: tuple[int, ...], itemsize: int, spec: P, sizes: Mapping[str, int]) -> int:
    """Bytes of one device's shard of an array of `shape` laid out by `spec` on a mesh whose axes
    have `sizes`.

    >>> shard_bytes((16, 32), 4, P("batch", "model"), {"batch": 2, "model": 4})
    256
    """
    return math.prod(-(-dim // n) for dim, n in zip(shape, _splits(spec, len(shape), sizes))) * itemsize


def _with_axis(axes: tuple[str | None, ...], dim: int | None, axis: str) -> P:
    out = list(axes)
    if dim is not None:
        out[dim] = axis
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _names(batch_axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis)


class ShardingPlan:
    """The layouts of every variable of one model (`variables`, in the order of the parameter
    tree's leaves) on `mesh`, whose rows lie along `batch_axis`; see the module doc. A tuple of
    batch axes is hybrid sharding (HSDP): ZeRO splits along the last (`zero_axis`, within a node),
    the others hold whole copies (`replica_axes`, across nodes)."""

    def __init__(self, mesh: Mesh, batch_axis: str | tuple[str, ...], zero_stage: int, variables: list[VariableLayout],
                 treedef: Any):
        self.mesh = mesh
        self.batch_axis = batch_axis
        self.zero_axis = _names(batch_axis)[-1]
        self.replica_axes = _names(batch_axis)[:-1]
        self.zero_stage = zero_stage
        self.variables = variables
        self.treedef = treedef

    @classmethod
    def make(cls, mesh: Mesh, batch_axis: str | tuple[str, ...], named: Mapping[str, Any] | Any,
             rules: Mapping[str, Any],
             zero_stage: int, min_shard_size: int = 1024, shard_dim: str = "largest",
             trainable: Any = None, paths: Any = None, every_rule_used: bool = True) -> "ShardingPlan":
        """The plan for `named` (a dict from path to array, or a tree of arrays whose paths are
        `paths`, a tree of strings alike); `trainable` (a tree of bools alike; default all) says
        which variables ZeRO may split.

        Raises:
          UsageError: a rule names an axis the mesh lacks or the batch axis, gives the wrong number
            of dimensions, or uses an axis twice; a variable's path matches several rules; a rule
            matches no variable (with `every_rule_used`).
        """
        if paths is None:
            paths, named = list(named), list(named.values())
        leaves, treedef = jax.tree.flatten(named)
        path_list = jax.tree.leaves(paths)
        flags = [True] * len(leaves) if trainable is None else jax.tree.leaves(trainable)
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
        compiled = [(key, re.compile(key), tuple(axes)) for key, axes in rules.items()]
        used: set[str] = set()
        out = []
        for path, leaf, flag in zip(path_list, leaves, flags):
            shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
            hits = [(key, axes) for key, rx, axes in compiled if rx.fullmatch(path)]
            if len(hits) > 1:
                raise UsageError(f"variable {path!r} matches several layout rules: {[k for k, _ in hits]}; "
                                 "make the regular expressions exclusive.")
            rule, axes = hits[0] if hits else (None, (None,) * len(shape))
            if rule is not None:
                used.add(rule)
                axes = _checked(path, shape, rule, axes, sizes, batch_axis)
                axes = tuple(None if a is not None and sizes[a] == 1 else a for a in axes)  # splits nothing
            zero_axis = _names(batch_axis)[-1]
            dim, why = _zero_dim(shape, axes, sizes[zero_axis], flag, zero_stage, min_shard_size, shard_dim)
            out.append(VariableLayout(
                path=path, shape=shape, itemsize=itemsize, trainable=flag, rule=rule, axes=axes, zero_dim=dim,
                why_whole=why, param_spec=_with_axis(axes, dim if zero_stage >= 3 else None, zero_axis),
                state_spec=_with_axis(axes, dim if zero_stage >= 1 else None, zero_axis),
                mesh_sizes=tuple(sizes.items())))
        unused = [key for key, _, _ in compiled if key not in used and every_rule_used]
        if unused:
            raise UsageError(f"layout rules {unused} match no variable of the model (a rule that matches nothing "
                             f"leaves what it meant to split whole on every device); the variables:\n"
                             + "\n".join(f"  {p}" for p in path_list))
        return cls(mesh, batch_axis, zero_stage, out, treedef)

    # --- specs as trees --------------------------------------------------------------------
    def tree(self, values: list[Any]) -> Any:
        """`values` (one per variable) as a tree shaped like the parameters."""
        return jax.tree.unflatten(self.treedef, values)

    def shardings(self, which: str) -> Any:
        """NamedShardings (a tree like the parameters) of the parameters (`"param"`) or of each
        parameter's optimizer state (`"state"`)."""
        return self.tree([NamedSharding(self.mesh, getattr(v, f"{which}_spec")) for v in self.variables])

    def gradient_specs(self) -> Any:
        """Where each trainable gradient lies once reduced over the replicas, as the batch axis
        alone says (the spec of a `shard_map` output): split along `zero_dim` from stage 1 on."""
        return self.tree([_with_axis((None,) * len(v.shape), v.zero_dim if self.zero_stage >= 1 else None,
                                     self.zero_axis) for v in self.variables])

    # --- what it costs -----------------------------------------------------------------------
    def replicated_fraction(self, min_shard_size: int = 0) -> float:
        """The fraction of trainable parameter bytes whose optimizer state no axis splits (those
        of variables under `min_shard_size` elements, left whole on purpose, not counted)."""
        total = sum(v.nbytes for v in self.variables if v.trainable)
        whole = sum(v.nbytes for v in self.variables
                    if v.trainable and not v.split and math.prod(v.shape) >= min_shard_size)
        return whole / total if total else 0.0

    def report(self) -> str:
        """A table of every variable: path, shape, parameter and optimizer-state layouts, parameter
        bytes per device, and the rule that matched (or why the batch axis leaves it whole)."""
        rows = [("path", "shape", "param layout", "state layout", "param bytes/device", "rule")]
        for v in self.variables:
            note = v.rule or "-"
            if v.zero_dim is None and v.trainable and self.zero_stage:
                note += f" (whole along {self.zero_axis!r}: {v.why_whole})"
            if v.padded:
                stored = {v.stored_shape(v.param_spec), v.stored_shape(v.state_spec)} - {v.shape}
                note += f" (stored padded to {' / '.join(map(str, sorted(stored)))})"
            rows.append((v.path, str(v.shape), _show(v.param_spec), _show(v.state_spec),
                         str(v.param_bytes_per_device), note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        total = sum(v.nbytes for v in self.variables)
        per_device = sum(v.param_bytes_per_device for v in self.variables)
        copies = f", whole copies along {self.replica_axes}" if self.replica_axes else ""
        lines.append(f"parameters: {total} bytes, {per_device} per device; ZeRO stage {self.zero_stage} along "
                     f"{self.zero_axis!r}{copies}; {self.replicated_fraction():.1%} of trainable bytes replicated on "
                     "every device")
        return "\n".join(lines)

    def gradient_bytes_per_device(self) -> int:
        """Bytes of the trainable gradients each device holds in a step: split along the batch axis
        from stage 2 on (stage 1 keeps whole ones until they are reduce-scattered)."""
        return sum(v.bytes_per_device(v.state_spec if self.zero_stage >= 2 else P(*v.axes))
                   for v in self.variables if v.trainable)


def _show(spec: P) -> str:
    return "replicated" if not any(a is not None for a in spec) else str(tuple(spec))


def _check_axes(rule: str, axes: tuple[Any, ...], sizes: Mapping[str, int], batch_axis: str | tuple[str, ...],
                path: str | None = None) -> dict[str, int]:
    """A rule's axes checked against the mesh: known, not the batch axis, each used once; returns
    which dimension each axis splits."""
    of = f" of variable {path!r}" if path else ""
    seen: dict[str, int] = {}
    for dim, axis in enumerate(axes):
        if axis is None:
            continue
        if axis not in sizes:
            raise UsageError(f"layout rule {rule!r} names mesh axis {axis!r}, which the mesh lacks (its axes: "
                             f"{tuple(sizes)}).")
        if axis in _names(batch_axis):
            raise UsageError(f"layout rule {rule!r} splits a dimension{of} along the batch axis {axis!r}, which "
                             "holds the replicas' rows: set `zero_stage` to shard variables along it.")
        if axis in seen:
            raise UsageError(f"layout rule {rule!r} splits dimensions {seen[axis]} and {dim}{of} along the same "
                             f"mesh axis {axis!r}: a mesh axis can split one dimension only.")
        seen[axis] = dim
    return seen


def _checked(path: str, shape: tuple[int, ...], rule: str, axes: tuple[Any, ...], sizes: dict[str, int],
             batch_axis: str | tuple[str, ...]) -> tuple[str | None, ...]:
    """A rule's axes for one variable, checked against the mesh and the variable's number of
    dimensions (a split that does not divide a dimension is padded)."""
    if len(axes) != len(shape):
        raise UsageError(f"layout rule {rule!r} gives {len(axes)} axes {axes} to variable {path!r} of shape "
                         f"{shape} ({len(shape)} dimensions): give one mesh axis name or None per dimension.")
    _check_axes(rule, axes, sizes, batch_axis, path)  # a split that does not divide is padded (module doc)
    return tuple(axes)


def _zero_dim(shape: tuple[int, ...], axes: tuple[str | None, ...], n: int, trainable: bool, stage: int,
              min_size: int, shard_dim: str) -> tuple[int | None, str]:
    """The dimension ZeRO splits `n` ways (one it divides if any: `shard_dim` picks among them;
    else one padded), or None and why not."""
    if not stage:
        return None, "ZeRO stage 0"
    if not trainable:
        return None, "not trainable"
    if n == 1:
        return None, "the batch axis has one device"
    if math.prod(shape) < min_size:
        return None, f"under min_shard_size={min_size} elements"
    free = [d for d in range(len(shape)) if axes[d] is None and shape[d] > 1]
    if not free:
        return None, "the layout splits every dimension of more than one element"
    free = [d for d in free if shape[d] % n == 0] or free  # one that divides, else padded (module doc)
    if shard_dim == "first":
        return free[0], ""
    if shard_dim == "last":
        return free[-1], ""
    return max(free, key=lambda d: (shape[d], -d)), ""


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """What a sharded strategy asks of the engine: layout `rules` (a dict from regular expression
    to axes), the ZeRO stage, the smallest variable ZeRO splits (elements), which dimension it
    splits, and the largest fraction of trainable bytes allowed to stay replicated."""

    rules: tuple[tuple[str, tuple[str | None, ...]], ...]
    zero_stage: int
    min_shard_size: int = 1024
    shard_dim: str = "largest"
    max_replicated_fraction: float = 0.02

    def check(self, axis_sizes: Mapping[str, int], batch_axis: str | tuple[str, ...]) -> None:
        """The rules checked against the mesh's axes before any variable exists (see `_checked`).

        Raises:
          UsageError: an unknown or batch axis, an axis used twice, or an unknown `shard_dim`.
        """
        if self.shard_dim not in SHARD_DIMS:
            raise UsageError(f"`shard_dim` must be one of {SHARD_DIMS}, got shard_dim={self.shard_dim!r}.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise UsageError(f"`zero_stage` must be 0, 1, 2 or 3, got zero_stage={self.zero_stage!r}.")
        for rule, axes in self.rules:
            _check_axes(rule, axes, axis_sizes, batch_axis)

    def layout_of(self, mesh: Mesh, batch_axis: str | tuple[str, ...], path: str, shape: tuple[int, ...], dtype: Any,
                  trainable: bool) -> P:
        """Where one variable lies (a Keras variable being created in the scope): its parameter's
        layout without the splits that do not divide it (`VariableLayout.variable_spec`)."""
        plan = ShardingPlan.make(mesh, batch_axis, {path: jax.ShapeDtypeStruct(shape, dtype)}, dict(self.rules),
                                 self.zero_stage, self.min_shard_size, self.shard_dim, trainable=[trainable],
                                 every_rule_used=False)
        return plan.variables[0].variable_spec

    def plan(self, mesh: Mesh, batch_axis: str | tuple[str, ...], params: Any, paths: Any, trainable: Any) -> ShardingPlan:
        """The plan of a model's parameters (a tree; `paths` and `trainable` trees alike).

        Raises:
          UsageError: see `ShardingPlan.make`; or more than `max_replicated_fraction` of the
            trainable bytes would stay replicated (the message holds the report).
        """
        plan = ShardingPlan.make(mesh, batch_axis, params, dict(self.rules), self.zero_stage, self.min_shard_size,
                                 self.shard_dim, trainable=trainable, paths=paths)
        fraction = plan.replicated_fraction(self.min_shard_size)
        if fraction > self.max_replicated_fraction:
            raise UsageError(
                f"{fraction:.1%} of the model's trainable bytes (variables of min_shard_size={self.min_shard_size} "
                f"elements or more) would stay replicated on every device, more than max_replicated_fraction="
                f"{self.max_replicated_fraction}: add layout rules that match them, set `zero_stage`, or raise "
                f"`max_replicated_fraction`. The layouts:\n{plan.report()}")
        return plan
