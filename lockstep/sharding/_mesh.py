"""`DeviceMesh` and `LayoutMap` with Keras' names: the devices as a grid of named axes, and rules
that say which mesh axes split which dimensions of a model's variables.

Keras' own `keras.distribution.DeviceMesh` and `LayoutMap` objects are accepted wherever these are
(`as_mesh`, `as_layout_map`).

>>> import lockstep as ls
>>> mesh = ls.DeviceMesh((2, 4), ("batch", "model"))
>>> mesh.shape, mesh.axis_names
((2, 4), ('batch', 'model'))
>>> layout = ls.LayoutMap(mesh)
>>> layout[".*dense.*/kernel"] = (None, "model")
>>> layout[".*dense.*/kernel"]
(None, 'model')
"""

from __future__ import annotations

import re

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from .._errors import UsageError


class DeviceMesh:
    """`devices` (default: all of them, in order) laid out as a grid of `shape` whose axes are
    named `axis_names` (Keras' `DeviceMesh`).

    With `devices` left out, the devices are found when the mesh is first used (`devices`,
    `jax_mesh`): a `ShardedStrategy` built on it first joins the job's other workers (as
    `MultiWorkerMirroredStrategy` does), so the mesh spans every worker's devices. Build the
    mesh, then the strategy, before any JAX computation.

    Raises:
      UsageError: the mesh needs more devices than there are, or its shape and names disagree.
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[Any] | None = None):
        shape = tuple(int(s) for s in shape)
        axis_names = tuple(str(a) for a in axis_names)
        if len(shape) != len(axis_names) or not shape or any(s < 1 for s in shape):
            raise UsageError(f"`shape` {shape} and `axis_names` {axis_names} must name one positive size per axis.")
        if len(set(axis_names)) != len(axis_names):
            raise UsageError(f"`axis_names` must be distinct, got {axis_names}.")
        self.shape = shape
        self.axis_names = axis_names
        self._given = None if devices is None else [_device(d) for d in devices]
        self._mesh: Mesh | None = None
        if self._given is not None:
            self._resolve()

    def _resolve(self) -> Mesh:
        if self._mesh is None:
            pool = list(jax.devices()) if self._given is None else self._given
            size = int(np.prod(self.shape))
            if size > len(pool) or (self._given is not None and size != len(pool)):
                raise UsageError(f"a mesh of shape {self.shape} needs {size} devices, but "
                                 f"{'there are' if self._given is None else '`devices` holds'} {len(pool)}.")
            devices = np.asarray(pool[:size], dtype=object).reshape(self.shape)
            self._mesh = Mesh(devices, self.axis_names, axis_types=(AxisType.Auto,) * len(self.shape))
        return self._mesh

    @property
    def resolved(self) -> bool:
        """Whether the devices are chosen already (given, or looked up by a first use)."""
        return self._mesh is not None

    @property
    def devices(self) -> np.ndarray:
        """The devices, an array of the mesh's shape."""
        return self._resolve().devices

    @property
    def jax_mesh(self) -> Mesh:
        """The mesh as JAX's `jax.sharding.Mesh` (axis types Auto)."""
        return self._resolve()

    def axis_size(self, name: str) -> int:
        """The number of devices along axis `name`."""
        return self.shape[self.axis_names.index(name)]

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self.shape}, axis_names={self.axis_names})"


def _device(d: Any) -> jax.Device:
    """A device given as a `jax.Device` or as Keras names it (``"cpu:3"``)."""
    if isinstance(d, jax.Device):
        return d
    platform, _, index = str(d).partition(":")
    for device in jax.devices(platform.lower() or None):
        if str(device.id) == index:
            return device
    raise UsageError(f"no device named {d!r} (the devices: {jax.devices()}).")


def as_mesh(mesh: Any) -> DeviceMesh:
    """`mesh` as a lockstep `DeviceMesh`: one already, a `keras.distribution.DeviceMesh`, or a
    `jax.sharding.Mesh`."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, Mesh):
        return DeviceMesh(mesh.devices.shape, mesh.axis_names, list(mesh.devices.flat))
    if hasattr(mesh, "axis_names") and hasattr(mesh, "devices") and hasattr(mesh, "shape"):  # Keras' DeviceMesh
        return DeviceMesh(mesh.shape, mesh.axis_names, list(np.asarray(mesh.devices).flat))
    raise UsageError(f"`mesh` must be a lockstep.DeviceMesh, a keras.distribution.DeviceMesh or a "
                     f"jax.sharding.Mesh, got {type(mesh).__name__}.")


class LayoutMap(MutableMapping):
    """Rules from variable paths to layouts (Keras' `LayoutMap`): each key is a regular expression
    fully matched against a variable's path (a Keras `variable.path` such as ``"dense_1/kernel"``,
    or a `FunctionalModel` parameter's keys joined by ``/``); each value names, for every dimension
    of the variable, the mesh axis that splits it, or None.
    """

    def __init__(self, device_mesh: Any = None):
        self.device_mesh = None if device_mesh is None else as_mesh(device_mesh)
        self._rules: dict[str, tuple[str | None, ...]] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise UsageError(f"a LayoutMap key must be a regular expression (str), got {key!r}.")
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"the LayoutMap key {key!r} is not a regular expression: {e} (keys fully match Keras "
                             "variable paths, say '.*dense.*/kernel').") from None
        axes = getattr(value, "axes", value)  # a Keras TensorLayout gives its axes
        if isinstance(axes, str) or not isinstance(axes, (tuple, list)):
            raise UsageError(f"the layout of {key!r} must be a tuple of mesh axis names or None (one per "
                             f"dimension), got {value!r}.")
        self._rules[key] = tuple(None if a is None else str(a) for a in axes)

    def __getitem__(self, key: str) -> tuple[str | None, ...]:
        return self._rules[key]

    def __delitem__(self, key: str) -> None:
        del self._rules[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"LayoutMap({self._rules})"


def as_layout_map(layout_map: Any) -> LayoutMap:
    """`layout_map` as a lockstep `LayoutMap`: one already, None (no rules), a
    `keras.distribution.LayoutMap`, or a dict of rules."""
    if isinstance(layout_map, LayoutMap):
        return layout_map
    out = LayoutMap(getattr(layout_map, "device_mesh", None))
    if layout_map is None:
        return out
    if not hasattr(layout_map, "items"):
        raise UsageError(f"`layout_map` must be a lockstep.LayoutMap, a keras.distribution.LayoutMap or a dict, "
                         f"got {type(layout_map).__name__}.")
    for key, value in layout_map.items():
        out[key] = value
    return out
