"""The `run` compiler: one replica's function as a compiled `shard_map` program, cached, with a
bound on the steps in flight.

Arguments are plain arrays, each of one *kind*:

- ``"rows"``: a global batch array split over replicas by rows (each replica sees its rows);
- ``"per_replica"``: a stacked ``(R, ...)`` array, one entry per replica (each sees its entry);
- ``"replicated"``: the same value on every replica;
- a `PartitionSpec` over the batch axis: a global array split as it says (each replica sees its
  slice: a sharded model's parameter or gradient shard);
- anything that is not an array is compiled in (hashable Python values such as `training=True`).

Outputs are plain global arrays too: replicated ones as they are, per-replica ones stacked
``(R, ...)``. The kinds of the outputs are either declared (`out_kinds`, the trainer's steps) or
read off the trace (what varies between replicas is per-replica: `strategy.run`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ._cross_replica import to_varying, varies
from ._in_flight import MAX_STEPS_IN_FLIGHT as MAX_STEPS_IN_FLIGHT
from ._in_flight import InFlight
from ._loops import loops_vary_their_carry
from ._replica_context import ReplicaContext, replica_context


ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
#: compiled programs kept (least recently used dropped first)
CACHE_SIZE = 256


def spec(kind: Any, batch_axis: str | tuple[str, ...]) -> P:
    """Where an argument or output of `kind` lies on the mesh: rows and per-replica entries split
    over `batch_axis`, replicated values on every device (a mesh's other axes hold copies), a
    `PartitionSpec` as it says.

    >>> spec("rows", "batch"), spec("replicated", "batch"), spec(P(None, "batch"), "batch")
    (P('batch',), P(), P(None, 'batch'))
    """
    if isinstance(kind, P):
        return kind
    if kind not in ("rows", "per_replica", "replicated"):
        raise ValueError(f"a kind must be 'rows', 'per_replica' or 'replicated', got {kind!r}.")
    return P(batch_axis) if kind != "replicated" else P()


class _Entry:
    """A compiled program and what it learned when first traced."""

    __slots__ = ("call", "flags", "out_tree")

    def __init__(self) -> None:
        self.call: Callable[..., Any] | None = None
        self.flags: tuple[bool, ...] | None = None  # per output leaf: replicated?
        self.out_tree: Any = None


class _Kinds:
    """The kinds of one subtree's leaves: not a pytree node, so it stays whole while flattening."""

    __slots__ = ("kinds",)

    def __init__(self, kinds: list[str]):
        self.kinds = kinds


def leaf_kinds(kinds: Any, args: Any) -> list[str]:
    """One kind per leaf of `args`, from `kinds` (a pytree prefix of `args`); non-arrays are static.

    >>> import numpy as np
    >>> leaf_kinds(("replicated", "rows"), ([np.ones(2), np.ones(3)], {"x": np.ones(4), "n": 3}))
    ['replicated', 'replicated', 'static', 'rows']
    """
    per = jax.tree.map(lambda k, sub: _Kinds([k] * len(jax.tree.leaves(sub))), kinds, args)
    flat = [k for group in jax.tree.leaves(per) for k in group.kinds]
    leaves = jax.tree.leaves(args)
    return [k if isinstance(x, ARRAY_TYPES) else "static" for k, x in zip(flat, leaves)]


def signature(x: Any) -> Any:
    """What a compiled program depends on: shape and dtype (dtype objects hash fast)."""
    try:
        return (x.shape, x.dtype)
    except AttributeError:
        return (type(x),)


def describe(fn: Any, kinds: list[str], signatures: list[Any]) -> str:
    """A short description of a program, the same on every worker that runs the same code: the
    function, its batch-like arguments' shapes, and a checksum of every argument's shape.

    >>> describe(len, ["replicated", "rows"], [((2, 3), "float32"), ((8,), "int32")])
    'builtins.len(1 replicated, rows int32[8]; shapes #1323490905)'
    """
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    replicated = sum(k == "replicated" for k in kinds)
    shown = [f"{k} {s[1]}{list(s[0])}" for k, s in zip(kinds, signatures) if k != "replicated" and len(s) == 2]
    checksum = zlib.crc32(repr((kinds, signatures)).encode())
    return f"{name}({', '.join([f'{replicated} replicated', *shown])}; shapes #{checksum})"


class RunCompiler:
    """Compiles and calls replica functions on `mesh`, whose replicas lie along `batch_axis`;
    `context(mask, count, typed)` makes each call's replica context (`typed`: traced with
    replication typing)."""

    def __init__(self, mesh: Mesh, batch_axis: str | tuple[str, ...], context: Callable[[Any, Any, bool], ReplicaContext],
                 manual_axes: frozenset[str] = frozenset()):
        self._mesh = mesh
        self._axis = batch_axis
        self._manual = manual_axes  # `shard_map`'s axis_names: empty, all axes
        self._context = context
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._in_flight = InFlight()
        self._lock = threading.Lock()
        self._agree: Callable[[str], None] | None = None

    def agree_with(self, check: Callable[[str], None] | None) -> None:
        """`check(description)` runs before each new program (several workers agree on it)."""
        self._agree = check

    def call_declared(self, fn: Callable[..., Any], args: tuple[Any, ...], kinds: Any, out_kinds: Any, *,
                      mask: Any = None, count: Any = None, check_vma: bool = True) -> Any:
        """Runs `fn(*args)` on every replica; its outputs are of the kinds `out_kinds` declares.

        Args:
          fn: the replica's function.
          args: its positional arguments (pytrees of arrays and hashable Python values).
          kinds: a pytree prefix of `args` naming each argument's kind (see the module doc).
          out_kinds: a pytree prefix of the outputs naming each one's kind (``"replicated"`` or
            ``"per_replica"``; hashable, such as a tuple of names).
          mask, count: the step's per-sample mask (split by rows) and real-sample count
            (replicated scalar), for the replica context (`None`: a context without a batch).
          check_vma: trace with `shard_map`'s replication typing (JAX's default). With `False`, a
            `lax.scan` whose carry starts replicated and becomes per-replica traces (every Keras
            recurrent layer), but gradients with respect to replicated arguments are per replica:
            the function must sum them itself.

        Returns:
          The outputs, plain global arrays.
        """
        call = _Call(fn, args, kinds, mask, count, ("declared", out_kinds, check_vma), shapes=self._agree is not None)
        entry = self._entry(call, lambda: self._compile_declared(call, out_kinds, check_vma))
        return self._run(entry, call)

    def jit(self, fn: Callable[..., Any], out_shardings: Any, donate_argnums: tuple[int, ...] = ()
            ) -> Callable[..., Any]:
        """`jax.jit(fn, ...)` run as this compiler's own programs are: the workers of a job agree on
        each new signature of its arguments before it runs, and its calls count among the steps in
        flight (a caller's program on global arrays, say a `mapped` step with work outside it)."""
        compiled = jax.jit(fn, out_shardings=out_shardings, donate_argnums=donate_argnums)
        agreed: set[Any] = set()
        last = bool(donate_argnums)  # its first output is what the next call takes over: no token

        def call(*args: Any) -> Any:
            if self._agree is not None:
                leaves, tree = jax.tree.flatten(args)
                signatures = [signature(x) for x in leaves]
                key = (tree, tuple(signatures))
                with self._lock:
                    if key not in agreed:
                        self._agree(describe(fn, ["global"] * len(leaves), signatures))
                        agreed.add(key)
            self._in_flight.make_room()  # (before the call: one interrupted while waiting has taken over nothing)
            return self._in_flight.tracked(compiled(*args), last_only=last)
        call.trace = compiled.trace  # type: ignore[attr-defined]  # (its jaxpr, XLA's `memory_analysis`)
        return call

    def mapped(self, fn: Callable[..., Any], kinds: Any, out_kinds: Any, *, check_vma: bool = True,
               with_batch: bool = True) -> Callable[..., Any]:
        """`fn` as a `shard_map` (not compiled: for a caller's own `jax.jit` around it) of
        ``(*args, mask, count)``: arguments of the kinds `kinds`, then a distributed batch's mask
        (split by rows) and real-sample count, which make the replica context (without
        `with_batch`: ``(*args)``, a context without a batch); outputs of the kinds `out_kinds`
        (`PartitionSpec`s among them: shards, as the replica returns them)."""
        axis = self._axis

        def replica(*args: Any) -> Any:
            mask = count = None
            if with_batch:
                *args, mask, count = args
            args = jax.tree.map(lambda k, sub: jax.tree.map(lambda x: x[0], sub) if k == "per_replica" else sub,
                                kinds, tuple(args))
            with self._entered(mask, count, check_vma):
                return _as_kinds(out_kinds, fn(*args), axis)

        in_specs = (*jax.tree.map(lambda k: spec(k, axis), kinds), *((P(axis), P()) if with_batch else ()))
        return jax.shard_map(replica, mesh=self._mesh, in_specs=in_specs,
                             out_specs=jax.tree.map(lambda k: spec(k, axis), out_kinds), check_vma=check_vma,
                             axis_names=self._manual)

    def call_inferred(self, fn: Callable[..., Any], args: tuple[Any, ...], kinds: Any, *, mask: Any = None,
                      count: Any = None, with_kwargs: bool = False) -> tuple[Any, tuple[bool, ...]]:
        """Runs `fn(*args)` on every replica (with `with_kwargs`, `args` is the pair ``(positional,
        keyword)``); what varies between replicas is per-replica, read off the trace (`strategy.run`).

        Returns:
          The outputs (plain global arrays) and, per output leaf, whether it is replicated.
        """
        call = _Call(fn, args, kinds, mask, count, ("inferred", with_kwargs))
        entry = self._entry(call, lambda: self._compile_inferred(call, with_kwargs))
        out = self._run(entry, call)
        assert entry.flags is not None
        return jax.tree.unflatten(entry.out_tree, list(out)), entry.flags

    def _entry(self, call: "_Call", compile_it: Callable[[], _Entry]) -> _Entry:
        """The cached program of `call` (the least recently used goes past `CACHE_SIZE`), compiled
        once the workers agree on it."""
        with self._lock:
            entry = self._entries.get(call.key)
            if entry is not None:
                self._entries.move_to_end(call.key)
                return entry
            if self._agree is not None:
                self._agree(call.description())
            entry = self._entries[call.key] = compile_it()
            if len(self._entries) > CACHE_SIZE:
                self._entries.popitem(last=False)
            return entry

    def _run(self, entry: _Entry, call: "_Call") -> Any:
        assert entry.call is not None
        return self._in_flight.tracked(entry.call(call.dynamic, call.context))

    @property
    def steps_in_flight(self) -> int:
        """Programs dispatched whose results the host has not waited for (at most MAX_STEPS_IN_FLIGHT)."""
        return len(self._in_flight)

    def compile_counts(self, fn: Callable[..., Any] | None = None) -> list[int]:
        """For each cached program of `fn` (every function if None), how often it compiled."""
        return [e.call._cache_size() for k, e in self._entries.items()
                if (fn is None or k[0] is fn or getattr(k[0], "fn", None) == fn) and e.call is not None]

    def _traced(self, call: "_Call", check_vma: bool, with_kwargs: bool = False) -> Callable[..., Any]:
        """`call`'s function on one replica's view of the arguments, in its replica context."""
        def traced(d: list[jax.Array], c: list[jax.Array]) -> Any:
            with self._entered(*(c or (None, None)), check_vma):
                if with_kwargs:
                    positional, keyword = call.rebuild(d)
                    return call.fn(*positional, **keyword)
                return call.fn(*call.rebuild(d))
        return traced

    @contextlib.contextmanager
    def _entered(self, mask: Any, count: Any, check_vma: bool) -> Any:
        """A replica's function traced in its replica context (the step's `mask` and `count`), with
        recurrent loops' carries typed as varying when traced with replication typing."""
        loops = loops_vary_their_carry(self._axis) if check_vma else contextlib.nullcontext()
        with replica_context(self._context(mask, count, check_vma)), loops:
            yield

    def _compile_declared(self, call: "_Call", out_kinds: Any, check_vma: bool) -> _Entry:
        entry = _Entry()
        traced = self._traced(call, check_vma)

        def declared(d: list[jax.Array], c: list[jax.Array]) -> Any:
            out = traced(d, c)
            entry.out_tree = jax.tree.structure(out)
            return _as_kinds(out_kinds, out, self._axis)

        out_specs = jax.tree.map(lambda k: spec(k, self._axis), out_kinds)
        entry.call = jax.jit(jax.shard_map(declared, mesh=self._mesh, in_specs=call.in_specs(self._axis),
                                           out_specs=out_specs,
                                           check_vma=check_vma, axis_names=self._manual))
        return entry

    def _compile_inferred(self, call: "_Call", with_kwargs: bool) -> _Entry:
        entry = _Entry()
        traced = self._traced(call, True, with_kwargs)

        def inferred(flags: tuple[bool, ...] | None, d: list[jax.Array], c: list[jax.Array]) -> tuple[Any, ...]:
            out_leaves, entry.out_tree = jax.tree.flatten(traced(d, c))
            try:
                out_leaves = [jnp.asarray(o) for o in out_leaves]
            except TypeError as e:
                raise TypeError(f"`fn` must return a pytree of arrays; {e}") from None
            if flags is None:
                entry.flags = tuple(not varies(o, self._axis) for o in out_leaves)
                return tuple(o[None] for o in out_leaves)
            return tuple(o if mirrored else o[None] for o, mirrored in zip(out_leaves, flags))

        probe = jax.shard_map(functools.partial(inferred, None), mesh=self._mesh, in_specs=call.in_specs(self._axis),
                              out_specs=P(self._axis), axis_names=self._manual)
        jax.eval_shape(probe, call.dynamic, call.context)
        flags = entry.flags
        assert flags is not None
        out_specs = tuple(P() if m else P(self._axis) for m in flags)
        entry.call = jax.jit(jax.shard_map(functools.partial(inferred, flags), mesh=self._mesh,
                                           in_specs=call.in_specs(self._axis), out_specs=out_specs,
                                           axis_names=self._manual))
        return entry


def note_new_function(fn: Callable[..., Any], where: Any = None, seen: dict[Any, Any] = {}) -> None:  # noqa: B006
    """Warns once when new function objects of one code over the same objects (closure, defaults)
    keep coming to one strategy (`where`), each compiled anew: TF's idiom of a `step_fn` defined inside the train step (a
    `tf.function` traces it once; here each new function object is a new program, as for
    `jax.jit`). New objects over other values (a loop over models or metrics) are not counted.

    >>> import warnings
    >>> scale = 2.0
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for i in range(5):
    ...         note_new_function(lambda x: x * scale)
    ...     for i in range(5):
    ...         note_new_function(lambda x, i=i: x * i)   # other values each time: no warning
    >>> len(caught)
    1
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    functions = seen.setdefault(code, weakref.WeakSet())
    if fn in functions:
        return
    functions.add(fn)
    cells = tuple(id(c.cell_contents) if _filled(c) else None for c in (getattr(fn, "__closure__", None) or ()))
    over = (id(where), code, cells, tuple(map(id, getattr(fn, "__defaults__", None) or ())))
    if len(seen) > 10_000:  # a record of a long run with new values each step: start it anew
        seen.clear()
    count = seen[over] = seen.get(over, 0) + 1
    if count == NEW_FUNCTIONS_WARNING:
        import warnings

        warnings.warn(
            f"`{code.co_name}` ({code.co_filename}:{code.co_firstlineno}) came as a new function object over the same "
            f"values {count} times, and each was compiled anew (a function defined inside the training step, as TF "
            "code defines `step_fn`, costs a compile every step): define it once, outside the loop, and pass what "
            "changes as arguments.", UserWarning, stacklevel=3)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


#: how many new function objects of one code compile before `note_new_function` warns
NEW_FUNCTIONS_WARNING = 4


class _Call:
    """One call's arguments split into arrays (`dynamic`) and compiled-in values, with its cache key.

    With `shapes=False` the key leaves the arrays' shapes and dtypes out: the compiled program
    (a `jax.jit`) keeps one executable per signature itself, and a step called thousands of times
    skips reading them (the workers of a job, who agree on each new program, keep them in).
    """

    def __init__(self, fn: Callable[..., Any], args: Any, kinds: Any, mask: Any, count: Any, mode: tuple[Any, ...],
                 shapes: bool = True):
        leaves, self.treedef = jax.tree.flatten(args)
        self.fn = fn
        arrays = tuple(isinstance(x, ARRAY_TYPES) for x in leaves)
        self.kinds = _kinds_of(kinds, args, self.treedef, arrays)
        if all(arrays):
            self.dynamic, self.statics = leaves, ()
        else:
            self.dynamic = [x for x, k in zip(leaves, self.kinds) if k != "static"]
            self.statics = tuple(x for x, k in zip(leaves, self.kinds) if k == "static")
        self.context = [] if mask is None else [mask, count]
        try:
            hash(self.statics)
        except TypeError:
            raise TypeError(
                f"`args` leaves that are not arrays must be hashable (they are compiled in), "
                f"got {[type(s).__name__ for s in self.statics]}.") from None
        signatures = tuple(signature(x) for x in self.dynamic) if shapes else None
        self.key = (fn, self.treedef, arrays, _hashable(kinds), self.statics, signatures, mask is None, mode)

    def description(self) -> str:
        """What the workers compare before compiling (see `describe`)."""
        return (describe(self.fn, [k for k in self.kinds if k != "static"], [signature(x) for x in self.dynamic])
                + f" {[type(x).__name__ for x in self.statics]} {not self.context} {self.key[-1]}")

    def in_specs(self, batch_axis: str | tuple[str, ...]) -> tuple[list[P], list[P]]:
        """Where the arrays and the context (mask split by rows, count replicated) lie."""
        return ([spec(k, batch_axis) for k in self.kinds if k != "static"],
                [P(batch_axis), P()][:len(self.context)])

    def rebuild(self, dynamic: list[jax.Array]) -> Any:
        """The arguments as one replica sees them (its entry of each per-replica array)."""
        d_it, s_it = iter(dynamic), iter(self.statics)
        leaves = []
        for kind in self.kinds:
            if kind == "static":
                leaves.append(next(s_it))
            else:
                x = next(d_it)
                leaves.append(x[0] if kind == "per_replica" else x)  # rows, replicated, a shard: as it is
        return jax.tree.unflatten(self.treedef, leaves)


_KINDS: dict[Any, list[str]] = {}


def _hashable(kinds: Any) -> Any:
    try:
        hash(kinds)
        return kinds
    except TypeError:
        return repr(kinds)


def _kinds_of(kinds: Any, args: Any, treedef: Any, arrays: tuple[bool, ...]) -> list[str]:
    """`leaf_kinds(kinds, args)`, remembered for each structure of the arguments."""
    key = (treedef, _hashable(kinds), arrays)
    found = _KINDS.get(key)
    if found is None:
        if len(_KINDS) > CACHE_SIZE:
            _KINDS.clear()
        found = _KINDS[key] = leaf_kinds(kinds, args)
    return found


def _as_kinds(out_kinds: Any, out: Any, batch_axis: str | tuple[str, ...]) -> Any:
    """A replica's outputs shaped for the kinds `out_kinds` (a pytree prefix of them) declares."""
    return jax.tree.map(lambda k, sub: jax.tree.map(functools.partial(_as_kind, k, batch_axis), sub), out_kinds, out)


def _as_kind(kind: Any, batch_axis: str | tuple[str, ...], x: Any) -> jax.Array:
    """An output leaf shaped for its declared kind (per-replica values get a leading replica axis;
    a shard, declared by its `PartitionSpec`, is as the replica made it)."""
    x = jnp.asarray(x)
    if isinstance(kind, P):
        return x
    if kind == "per_replica":
        return to_varying(x, batch_axis)[None]
    if kind != "replicated":
        raise ValueError(f"an output kind must be 'replicated' or 'per_replica', got {kind!r}.")
    if varies(x, batch_axis):  # (unchecked traces type nothing as varying: there the step vouches for it)
        raise ValueError(
            f"a step output declared replicated differs between replicas (shape {x.shape}, dtype {x.dtype}): "
            "combine it across replicas (an all-reduce) before returning it.")
    return x

