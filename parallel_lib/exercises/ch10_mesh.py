"""Chapter 10's exercise on the rank grid: a global rank's (dp, tp, pp) coordinates for a given axis order.

``Mesh(dp, tp, pp, order=...)`` lays ``torch.arange(world)`` out so that the *first* axis of ``order``
varies fastest; which axis that is decides which groups hold neighbouring ranks (one node). The
student writes the arithmetic the mesh does with a reshape; the checker compares with
:meth:`parallel_lib.runtime.mesh.Mesh.coords` on every rank of meshes of several shapes and orders,
and recognises the typical mistakes: the order read slowest-first, one order used for every mesh,
an axis's own size taken as its stride, and the remainder forgotten.
"""

from __future__ import annotations

from typing import Any, Optional

from parallel_lib.exercises._core import Case, CheckResult, as_int, check_function, show
from parallel_lib.runtime.mesh import Mesh

__all__ = ["MESH_COORDS_STUB", "check_mesh_coords"]

MESH_COORDS_STUB = '''\
def mesh_coords(rank, dp, tp, pp, order):
    """The coordinates of global `rank` on a mesh of dp x tp x pp ranks laid out in `order`.

    order names the three axes joined by "-", the FASTEST-varying first: under "tp-pp-dp", ranks 0 and 1
    differ in tp only (when tp > 1), and dp changes slowest. Return dict(dp=..., tp=..., pp=...), each
    coordinate counted from 0.
    """
    ...  # your code here
'''

_AXES = ("dp", "tp", "pp")
# (dp, tp, pp, order): the course's default, Megatron-LM's (pp slowest), odd sizes, and orders that put dp or pp first
_MESHES = ((2, 2, 2, "tp-pp-dp"), (2, 2, 2, "tp-dp-pp"), (3, 2, 4, "tp-pp-dp"), (3, 2, 4, "tp-dp-pp"),
           (2, 4, 3, "dp-tp-pp"), (4, 2, 3, "pp-tp-dp"), (1, 8, 2, "tp-pp-dp"))


def _reference(rank: int, dp: int, tp: int, pp: int, order: str) -> dict[str, int]:
    coords = Mesh(dp=dp, tp=tp, pp=pp, order=order).coords(rank)
    return {axis: coords[axis] for axis in _AXES}


def _by_strides(rank: int, sizes: dict[str, int], order: list[str], *, own_stride: bool = False,
                remainder: bool = True) -> dict[str, int]:
    """The coordinates under a stride rule: the correct one, or a typical mistake's."""
    out, stride = {}, 1
    for axis in order:
        step = sizes[axis] if own_stride else stride
        out[axis] = rank // step % sizes[axis] if remainder else rank // step
        stride *= sizes[axis]
    return out


def _normalise(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or set(value) != set(_AXES):
        raise TypeError(f"a dict with the keys dp, tp and pp, e.g. dict(dp=0, tp=1, pp=0), got {show(value, 80)}")
    return {axis: as_int(value[axis]) for axis in _AXES}


def _hint(args: tuple, got: Any) -> str:
    rank, dp, tp, pp, order = args
    sizes, axes = dict(dp=dp, tp=tp, pp=pp), order.split("-")
    if not isinstance(got, dict):
        return ""
    mistakes: list[tuple[Optional[dict], str]] = [
        (_by_strides(rank, sizes, axes[::-1]), "the order was read slowest-first: order lists the fastest-varying "
         "axis first (consecutive ranks differ in it)"),
        (_by_strides(rank, sizes, ["tp", "pp", "dp"]) if order != "tp-pp-dp" else None,
         "one order (tp, then pp, then dp) was used for every mesh: the order is an argument"),
        (_by_strides(rank, sizes, axes, own_stride=True), "an axis's own size was taken as its stride: how many ranks "
         "go by before the coordinate of an axis changes by one?"),
        (_by_strides(rank, sizes, axes, remainder=False), "a coordinate came out as large as its axis or larger: what "
         "happens to an axis's coordinate when the next axis moves on?"),
    ]
    for wrong, what in mistakes:
        if wrong is not None and got == wrong:
            return what
    return "the fastest axis changes with every rank; the next one changes once the fastest has gone through its size"


def check_mesh_coords(fn: Any) -> CheckResult:
    """Check ``mesh_coords(rank, dp, tp, pp, order)`` against :meth:`Mesh.coords` on every rank of 7 meshes."""
    cases = [Case((rank, dp, tp, pp, order), _reference(rank, dp, tp, pp, order))
             for dp, tp, pp, order in _MESHES for rank in range(dp * tp * pp)]
    return check_function("mesh_coords", fn, "mesh_coords", cases, normalise=_normalise, hint=_hint)
