"""The package's shape: sizes, no import cycles, a launcher without JAX, a public API without internals."""

import ast
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

import lockstep as ls

PACKAGE = pathlib.Path(ls.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: pathlib.Path) -> str:
    parts = ["lockstep", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of the package that `path` imports anywhere: at module level, inside functions and
    in `if TYPE_CHECKING:` blocks (a lazy import is a dependency all the same)."""
    name = _name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lockstep"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("lockstep"):
                continue
            for alias in node.names:  # `from . import x` imports the submodule x
                sub = f"{mod}.{alias.name}"
                found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists()
                          or (PACKAGE.parent / sub.replace(".", "/")).is_dir() else mod)
    found.discard(name)
    # importing a submodule imports its parent packages first: that is not a dependency on them
    return {d for d in found if not name.startswith(d + ".")}


GRAPH = {_name(p): _imports(p) for p in MODULES}


def _part(module: str) -> str:
    """The part of the package a module belongs to: its subpackage (``lockstep.engine``), or the
    top-level module itself (``lockstep.losses``)."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles = []
    state: dict[str, int] = {}

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                walk(d, path + [d])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    return cycles


def test_no_module_class_or_function_is_oversized():
    too_big = []
    for path in MODULES:
        text = path.read_text()
        lines = text.count("\n")
        if lines > 500:
            too_big.append(f"{_name(path)}: module of {lines} lines")
        for node in ast.walk(ast.parse(text)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > 300:
                too_big.append(f"{_name(path)}.{node.name}: class of {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 80:
                too_big.append(f"{_name(path)}.{node.name}: function of {size} lines")
    assert not too_big, too_big


def test_no_import_cycle_between_modules_of_the_package():
    assert not _cycles(GRAPH), _cycles(GRAPH)


def test_no_import_cycle_between_the_parts_of_the_package():
    parts: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        if module != "lockstep":  # the root re-exports every part
            parts.setdefault(_part(module), set()).update(_part(d) for d in deps if _part(d) != _part(module))
    assert not _cycles(parts), _cycles(parts)


ENGINE_MAY_IMPORT = {"lockstep.engine", "lockstep._errors", "lockstep._optional"}


def test_the_engine_imports_nothing_above_it():
    above = {m: sorted(d for d in deps if _part(d) not in ENGINE_MAY_IMPORT)
             for m, deps in GRAPH.items() if _part(m) == "lockstep.engine"}
    assert not any(above.values()), {m: d for m, d in above.items() if d}


def test_the_launcher_imports_only_the_exit_codes():
    found = {m: sorted(d for d in deps if _part(d) not in {"lockstep.launch", "lockstep._exit_codes"})
             for m, deps in GRAPH.items() if _part(m) in ("lockstep.launch", "lockstep.cli")}
    assert not any(found.values()), found


def test_the_launcher_imports_no_jax():
    code = "import sys, lockstep.launch, lockstep.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'optax', 'keras')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("internal", ["DistributedBatch", "sync_state", "StateSpec", "free_port",
                                      "shardings_of"])
def test_the_public_api_holds_no_internals(internal):
    for module in (ls, ls.metrics, ls.callbacks, ls.checkpoint, ls.launch):
        assert internal not in getattr(module, "__all__", []), (module.__name__, internal)
        assert not hasattr(module, internal), (module.__name__, internal)


def test_every_public_name_resolves():
    for module in (ls, ls.metrics, ls.callbacks, ls.checkpoint, ls.launch, ls.data, ls.training):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)
    assert importlib.import_module("lockstep").Trainer is ls.keras.Trainer  # a training.Trainer for Keras models too
    assert issubclass(ls.Trainer, ls.training.Trainer) and ls.memory_estimate is ls.keras.memory_estimate


def test_packages_use_each_other_through_their_init_only():
    """Each package exports what the others use from its `__init__` (issue 42): no module reaches
    into another package's private modules. The public faces that compose them, `lockstep/__init__.py`
    and `lockstep/experimental.py`, may."""
    reaching = sorted(
        f"{name} imports {dep}" for name, deps in GRAPH.items() if name not in ("lockstep", "lockstep.experimental")
        for dep in deps
        if len(dep.split(".")) >= 3 and dep.split(".")[2].startswith("_") and _part(dep) != _part(name))
    assert not reaching, "\n".join(reaching)


def test_keras_own_behaviour_is_changed_by_the_top_part_alone():
    """Issue 42: no part registers hooks in another. Keras follows lockstep's scopes because the
    public faces import `lockstep.keras` (the top part), which nothing else imports."""
    importers = sorted(m for m, deps in GRAPH.items()
                       if _part(m) != "lockstep.keras" and any(_part(d) == "lockstep.keras" for d in deps))
    assert importers == ["lockstep", "lockstep.experimental"], importers
    registering = sorted(f"{_name(p)}: {ast.unparse(node.func)}" for p in MODULES for node in _registrations(p))
    assert not registering, registering


def _registrations(path: pathlib.Path) -> list[ast.Call]:
    """Calls that add to a list, set or dict held by another lockstep module (``_scope.KERAS_HOOKS.append``)."""
    tree = ast.parse(path.read_text())
    modules = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.level or (node.module or "").startswith("lockstep")) for a in node.names
               if a.name.startswith("_") or a.name[:1].islower() and "." not in a.name}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend", "insert", "add", "update", "setdefault")
            and isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id in modules]


def _printed_by(code: str) -> list[str]:
    """What `code` prints (split into words), run by a fresh Python on 2 CPU devices: what a user's
    script meets on its first import of lockstep."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "KERAS_BACKEND": "jax"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.parametrize("entry", ["from lockstep import MirroredStrategy as S",
                                   "from lockstep.experimental import CentralStorageStrategy as S",
                                   "import lockstep as ls; S = ls.Trainer and ls.MirroredStrategy"])
def test_keras_fit_in_a_scope_runs_through_lockstep_whichever_public_name_gave_the_strategy(entry):
    code = (f"{entry}\nimport keras, numpy as np\n"
            "with S(2).scope():\n"
            "    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
            "    m.compile(optimizer='sgd', loss='mse')\n"
            "m.fit(np.ones((5, 3), 'float32'), np.ones(5, 'float32'), batch_size=4, verbose=0)\n"
            "print(type(m.__dict__['_lockstep_trainer'][1]).__name__, len(m.variables[0].value.sharding.device_set))")
    assert _printed_by(code) == ["Trainer", "2"]


def test_a_scope_keras_does_not_follow_is_warned_about():
    """A strategy made from a private module, before any public name installed `lockstep.keras`:
    its scope says that Keras would not follow it (models built on one device), never silently."""
    code = ("import warnings, keras\nfrom lockstep.distribute._strategy import MirroredStrategy\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    with MirroredStrategy(2).scope():\n"
            "        pass\n"
            "print(any('Keras does not follow this lockstep scope' in str(w.message) for w in caught))\n"
            "import lockstep as ls\n"
            "with warnings.catch_warnings():\n"
            "    warnings.simplefilter('error')\n"
            "    with ls.MirroredStrategy(2).scope():\n"
            "        print(len(keras.distribution.distribution().device_mesh.devices.flat))\n")
    assert _printed_by(code) == ["True", "2"]
