"""Send a function written in a notebook cell to spawned ranks, as its source.

``parallel_lib.runtime.launcher`` starts fresh interpreters, which import a worker function
by module and name; a function defined in a notebook cell lives in the kernel's
``__main__`` and cannot be imported there. So the checker ships the student's
*source* (IPython keeps every cell's source, and ``inspect.getsource`` finds it),
together with the globals it names that a fresh process can rebuild: modules (by
name, so ``import torch.distributed as dist`` in another cell works) and importable
objects such as ``from torch.distributed import all_reduce``. Each rank compiles
the source and calls it. A helper function from another cell cannot travel this way;
the rank then raises NameError, and the checker says so. A function that lives in an
importable module (the library's own reference) travels by reference instead.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import sys
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["ShippedFunction", "ship"]


@dataclass(frozen=True)
class ShippedFunction:
    """A function in a form that pickles into a spawned process; ``load()`` there gives it back."""

    name: str
    function: Optional[Callable] = None  # set when the function can be imported by reference
    source: str = ""
    modules: dict[str, str] = field(default_factory=dict)   # global name -> module to import
    objects: dict[str, Any] = field(default_factory=dict)   # global name -> picklable value

    def load(self) -> Callable:
        if self.function is not None:
            return self.function
        namespace: dict[str, Any] = {"__name__": "__student__"}
        namespace.update({alias: importlib.import_module(module) for alias, module in self.modules.items()})
        namespace.update(self.objects)
        exec(compile(self.source, f"<{self.name}, from the notebook>", "exec"), namespace)  # noqa: S102
        return namespace[self.name]


def _importable(fn: Callable) -> bool:
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return False
    target: Any = module
    for part in getattr(fn, "__qualname__", "").split("."):
        target = getattr(target, part, None)
    return target is fn


def _global_names(code: types.CodeType) -> set[str]:
    """Names a code object (and the functions and comprehensions nested in it) may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _picklable_elsewhere(value: Any) -> bool:
    if getattr(value, "__module__", None) == "__main__":  # pickles here, but no other process can import it
        return False
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - any pickling failure means: cannot travel
        return False
    return True


def ship(fn: Callable) -> ShippedFunction:
    """Package ``fn`` for spawned ranks.

    Raises:
        ValueError: its source cannot be read (a lambda or a function made by ``exec``);
            the message says how to define it instead.
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    if _importable(fn):
        return ShippedFunction(name, function=fn)
    code = getattr(fn, "__code__", None)
    try:
        if code is None or name == "<lambda>":
            raise TypeError("not a plain function")
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as error:
        raise ValueError(f"the checker cannot read the source of {name!r} ({error}): define it with "
                         "`def` in a notebook cell and run that cell") from None
    modules: dict[str, str] = {}
    objects: dict[str, Any] = {}
    for alias in _global_names(code) & set(fn.__globals__):
        value = fn.__globals__[alias]
        if isinstance(value, types.ModuleType):
            modules[alias] = value.__name__
        elif _picklable_elsewhere(value):
            objects[alias] = value
    return ShippedFunction(name, source=source, modules=modules, objects=objects)
