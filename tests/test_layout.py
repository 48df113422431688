"""The library's layout: one folder per strategy, and lower layers never import upper ones.

A reader finds "the ring all-reduce" in ``data_parallel/`` and "what launches ranks" in
``runtime/``; a chapter adds a folder. The rule that keeps this readable is checked here
on the source: each folder imports only from itself and from folders of a lower layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "parallel_lib"

# layer of each folder (top-level modules such as check_gpu.py and figures.py are "top")
LAYERS = {
    "common": 0,
    "runtime": 1,
    "data": 2, "models": 2,
    "data_parallel": 3, "model_parallel": 3,
    "pipeline_parallel": 4, "sharding": 4, "tensor_parallel": 4,
    "hybrid": 5, "inference": 5,
    "planner": 6,
    "viz": 7, "bench": 7, "exercises": 7, "top": 7,
}


def _folder(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else "top"


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, "parallel_lib.x.y")`` for every import of the package in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text())
    module = ".".join(("parallel_lib",) + path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "parallel_lib":  # from parallel_lib import x
                found += [(node.lineno, f"parallel_lib.{a.name}") for a in node.names]
            elif target.startswith("parallel_lib."):
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("parallel_lib.")]
    return found


def _target_folder(target: str) -> str:
    part = target.split(".")[1]
    return part if (PACKAGE / part).is_dir() else "top"


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYERS), f"give {sorted(folders - set(LAYERS))} a layer in LAYERS"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_only(path):
    here = _folder(path)
    top = max(LAYERS.values())  # the top layer (viz, bench, exercises, scripts) may use itself
    upward = [(line, target) for line, target in _imports(path)
              if _target_folder(target) != here and LAYERS[_target_folder(target)] >= LAYERS[here]
              and not LAYERS[here] == LAYERS[_target_folder(target)] == top]
    assert not upward, f"{path.relative_to(PACKAGE)} (layer {LAYERS[here]}) imports upward or sideways: {upward}"


def test_viz_only_draws():
    """Plots take data; launching ranks and timing models happens in the library (see figures.py)."""
    for path in (PACKAGE / "viz").glob("*.py"):
        source = path.read_text()
        targets = [t for _, t in _imports(path)]
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
