"""The library's layout: one folder per idea, in layers, and no module imports from a higher layer.

A reader finds "the ring all-reduce" in ``data_parallel/`` and "what launches ranks" in
``runtime/``; a chapter adds a folder. What keeps this readable is that the layers only look
down, checked here on the source of every module of ``parallel_lib`` with ``ast``.

The rule. A *unit* is a folder of ``parallel_lib`` or one of its top-level modules; :data:`LAYERS`
gives each its layer (DESIGN.md's table; ``check_gpu.py``, ``figures.py`` and ``quickstart.py``
are applications at the top, and the package's ``__init__.py``, which imports nothing, is at the
bottom). A module may import

- anything from its own unit, and from every unit of a lower layer;
- from another unit of its *own* layer only where :data:`SIDEWAYS` names the pair. Today that is
  one pair of layer 3, where chapter 06 reuses chapter 02's ring (``sharding/`` takes
  the ring's halves for ZeRO), one of layer 0
  (``cost/`` checks its arguments with ``common/``'s checks), and one of layer 5, where
  chapter 13's ``serving/`` takes chapter 09's requests, results and sampling from ``inference/``
  (so both engines give a request the same tokens); every other pair of layers
  0 to 6 is independent, and a new pair is added to :data:`SIDEWAYS` with its reason. The pairs
  must not form a cycle. Layer 7 is the top (drawing, benchmarks, exercises, the GPU checks,
  figures): its units use each other freely, since nothing below may import them.

An import inside a function counts like one at the top of the module (it is still an upward
dependency, only a later one), and so does ``importlib.import_module("parallel_lib...")``. The
one exception: an import inside the function ``main`` of a command-line module (``__main__.py``
or ``cli.py``), which runs only when a reader runs that command, never when the library is
imported.

:data:`KNOWN_VIOLATIONS` lists the upward imports that exist and cannot be fixed yet, each with
its reason; it is empty. A new one fails :func:`test_no_module_imports_from_a_higher_layer`; a
listed one that disappears fails :func:`test_known_violations_still_exist` until it is removed
from the list.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "parallel_lib"

LAYERS = {
    "__init__": 0, "common": 0, "cost": 0,
    "runtime": 1, "data": 1,
    "models": 2,
    "data_parallel": 3, "sharding": 3, "model_parallel": 3, "tensor_parallel": 3, "context_parallel": 3,
    "expert_parallel": 3,
    "pipeline_parallel": 4,
    "training": 5, "inference": 5, "serving": 5,
    "planner": 6,
    "viz": 7, "bench": 7, "exercises": 7, "gpu_checks": 7, "figures": 7, "check_gpu": 7, "quickstart": 7,
}
TOP = max(LAYERS.values())

# (importing unit, imported unit) of the same layer below the top, with the reason it is allowed
SIDEWAYS = {
    ("cost", "common"): "the cost formulas check their arguments with common.checks' one message format",
    ("sharding", "data_parallel"): "ZeRO's ring collectives are chapter 02's ring halves",
    ("serving", "inference"): "chapter 13 serves chapter 09's requests and results, sampled by the same rule",
}

# (module, imported module) upward imports that exist today and wait for a file another part of
# issue #20 is rewriting; each entry says why. A new upward import never goes here: fix it
# (move the helper down to the layer where it belongs, or pass it in as a parameter).
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {
    # none: the check found no upward import when it was written (issue #20)
}


def unit_of(path: Path) -> str:
    """The unit of a module of the package: its folder, or its own name at the top level."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _target_unit(target: str) -> Optional[str]:
    """``"parallel_lib.training.plan"`` -> ``"training"``; ``None`` for the bare package."""
    parts = target.split(".")
    return parts[1] if len(parts) > 1 else None


def _is_cli_main(path: Path, function: Optional[str]) -> bool:
    return function == "main" and path.name in ("__main__.py", "cli.py")


def imports(path: Path, source: Optional[str] = None) -> list[tuple[int, str, Optional[str]]]:
    """Every import of the package in a module: ``(line, "parallel_lib.x.y", enclosing function or None)``.

    Relative imports are resolved; ``from parallel_lib import x`` counts as importing
    ``parallel_lib.x``; a constant ``importlib.import_module("parallel_lib.x")`` counts too.

    Args:
        path: the module's path under ``parallel_lib/`` (it need not exist when ``source`` is given).
        source: the module's text; read from ``path`` when omitted.
    """
    tree = ast.parse(path.read_text() if source is None else source)
    module = ".".join(("parallel_lib",) + path.relative_to(PACKAGE).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, function: Optional[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = function or node.name  # the outermost function names the place
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "parallel_lib":
                targets = [f"parallel_lib.{alias.name}" for alias in node.names]
            elif target.startswith("parallel_lib."):
                targets = [target]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.startswith("parallel_lib.")]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.startswith("parallel_lib.")):
            targets = [node.args[0].value]
        found.extend((node.lineno, target, function) for target in targets)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def upward_imports(path: Path, source: Optional[str] = None) -> list[tuple[int, str]]:
    """The imports of a module that break the rule of this file's docstring: ``(line, imported module)``.

    Raises:
        KeyError: the module's unit, or a unit it imports, has no layer in ``LAYERS``.
    """
    here = unit_of(path)
    wrong = []
    for line, target, function in imports(path, source):
        there = _target_unit(target)
        if there is None or there == here or _is_cli_main(path, function):
            continue
        if there not in LAYERS:
            raise KeyError(f"{path.relative_to(PACKAGE)}:{line} imports {target}: give {there!r} a layer in LAYERS")
        if LAYERS[there] < LAYERS[here]:
            continue
        if LAYERS[there] == LAYERS[here] and (LAYERS[here] == TOP or (here, there) in SIDEWAYS):
            continue
        wrong.append((line, target))
    return wrong


MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_every_unit_has_a_layer():
    units = {unit_of(p) for p in MODULES}
    assert units <= set(LAYERS), f"give {sorted(units - set(LAYERS))} a layer in LAYERS (see this file's docstring)"


def test_sideways_pairs_are_same_layer_below_the_top_and_form_no_cycle():
    for here, there in SIDEWAYS:
        assert LAYERS[here] == LAYERS[there] < TOP, (here, there)
    graph = {}
    for here, there in SIDEWAYS:
        graph.setdefault(here, set()).add(there)

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    assert not [unit for unit in graph if reaches(unit, unit)]


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_imports_from_a_higher_layer(path):
    new = [(line, target) for line, target in upward_imports(path) if (_name(path), target) not in KNOWN_VIOLATIONS]
    assert not new, (f"{_name(path)} (unit {unit_of(path)!r}, layer {LAYERS[unit_of(path)]}) imports from a higher "
                     f"layer or sideways: {new}; move what it needs down, or pass it in (see tests/test_layers.py)")


def test_known_violations_still_exist():
    """A fixed violation leaves the list, so the list only shrinks."""
    found = {(_name(p), target) for p in MODULES for _, target in upward_imports(p)}
    assert not set(KNOWN_VIOLATIONS) - found, f"fixed, remove from KNOWN_VIOLATIONS: {set(KNOWN_VIOLATIONS) - found}"


@pytest.mark.parametrize("module, source, expected", [
    # upward, at the top of a module, inside a function, relative, as `from parallel_lib import x`, by importlib
    ("runtime/fake.py", "from parallel_lib.training.plan import Plan", [(1, "parallel_lib.training.plan")]),
    ("runtime/fake.py", "def f():\n    import parallel_lib.planner.search as s", [(2, "parallel_lib.planner.search")]),
    ("runtime/fake.py", "from ..pipeline_parallel import Pipe", [(1, "parallel_lib.pipeline_parallel")]),
    ("common/fake.py", "from parallel_lib import data", [(1, "parallel_lib.data")]),
    ("data/fake.py", "import importlib\nm = importlib.import_module('parallel_lib.models.gpt2')",
     [(2, "parallel_lib.models.gpt2")]),
    # sideways: only the listed pairs below the top; the top is free
    ("sharding/fake.py", "from parallel_lib.tensor_parallel import layers", [(1, "parallel_lib.tensor_parallel")]),
    ("common/fake.py", "from parallel_lib.cost import shapes", [(1, "parallel_lib.cost")]),
    ("sharding/fake.py", "from parallel_lib.data_parallel.ring import ring_all_gather", []),
    ("bench/fake.py", "from parallel_lib.viz import ring\nfrom parallel_lib import quickstart", []),
    # down, and within the unit
    ("training/fake.py", "from parallel_lib.pipeline_parallel import Pipe\nfrom . import plan\nimport parallel_lib", []),
    # a command-line main may use a higher layer; the same import elsewhere may not
    ("runtime/__main__.py", "def main():\n    from parallel_lib.planner import plan", []),
    ("runtime/cli.py", "def main():\n    def inner():\n        from parallel_lib.planner import plan", []),
    ("runtime/launcher.py", "def main():\n    from parallel_lib.planner import plan", [(2, "parallel_lib.planner")]),
    ("runtime/__main__.py", "def run():\n    from parallel_lib.planner import plan", [(2, "parallel_lib.planner")]),
])
def test_the_rule_on_made_up_modules(module, source, expected):
    assert upward_imports(PACKAGE / module, source) == expected


def test_a_unit_without_a_layer_is_named():
    with pytest.raises(KeyError, match="give 'newfolder' a layer in LAYERS"):
        upward_imports(PACKAGE / "runtime" / "fake.py", "from parallel_lib.newfolder import x")


# --- names each module promises -------------------------------------------------------------------


def _all_node(tree: ast.Module) -> Optional[ast.expr]:
    """The value assigned to ``__all__`` at the module's top level, if any."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return node.value
    return None


def _module(path: Path):
    return importlib.import_module(".".join(("parallel_lib",) + path.relative_to(PACKAGE).with_suffix("").parts)
                                   .removesuffix(".__init__"))


def _module_level_names(body: list[ast.stmt]) -> set[str]:
    """Names a module binds at its top level, inside top-level if/try/with blocks too, never inside a function."""
    defined = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for block in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.ExceptHandler)) and hasattr(node, block):
                defined |= _module_level_names(getattr(node, block))
    return defined


WITH_ALL = [p for p in MODULES if _all_node(ast.parse(p.read_text())) is not None]


@pytest.mark.parametrize("path", WITH_ALL, ids=_name)
def test_all_lists_only_names_the_module_defines(path):
    """``from parallel_lib.x import *`` and the docs read ``__all__``: a stale name there is an ImportError."""
    tree = ast.parse(path.read_text())
    value, defined = _all_node(tree), _module_level_names(tree.body)
    literal = isinstance(value, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in value.elts)
    if literal and "__getattr__" not in defined:  # read from the source: no import needed
        names = [e.value for e in value.elts]
        missing = [name for name in names if name not in defined]
    else:  # __all__ built from other names, or names made on demand (lazy imports): ask the module itself
        module = _module(path)
        names = list(module.__all__)
        missing = [name for name in names if not hasattr(module, name)]
    assert len(names) == len(set(names)), f"{_name(path)}: __all__ lists a name twice"
    assert not missing, f"{_name(path)}: __all__ lists {missing}, which it does not define"


# --- what else keeps the layout readable ----------------------------------------------------------


def test_viz_only_draws():
    """Plots take data; launching ranks and timing models happens in the library (see figures.py)."""
    for path in (PACKAGE / "viz").glob("*.py"):
        source = path.read_text()
        targets = [t for _, t, _ in imports(path)]
        assert not any(t.startswith(("parallel_lib.runtime.launcher", "parallel_lib.bench")) for t in targets), path
        code = "\n".join(line for line in source.splitlines() if "``" not in line)  # docstrings may mention it
        assert "launch(" not in code, f"{path.name} launches ranks"


def test_the_launching_module_is_not_called_dist():
    """``import torch.distributed as dist`` sits in the same files; a module named dist would clash."""
    assert not list(PACKAGE.rglob("dist.py"))


def test_a_module_never_shares_its_name_with_a_function_its_package_exports():
    """``parallel_lib.runtime.devices`` would be shadowed by the function ``devices`` re-exported there."""
    for init in PACKAGE.glob("*/__init__.py"):
        exported = set()
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                exported |= {a.asname or a.name for a in node.names}
        clashes = {p.stem for p in init.parent.glob("*.py")} & exported
        assert not clashes, f"{init.parent.name}: modules {clashes} are shadowed by exported names"
