"""The mesh: every rank laid out once on named axes, every process group a slice of it.

A run that combines parallelisms gives each rank a coordinate on five axes::

    dp  data parallel      replicas that average gradients (ZeRO shards over it)
    pp  pipeline parallel  stages that hand activations forward and gradients back
    ep  expert parallel    ranks that hold different experts of a mixture-of-experts layer
    cp  context parallel   ranks that hold different pieces of a long sequence
    tp  tensor parallel    ranks that split every matrix multiply of a layer

An absent axis has size 1. As picotron's process-group manager does, the layout is
``torch.arange(world_size)`` reshaped so that the *first* axis of ``order`` varies fastest;
:attr:`Mesh.ranks` always indexes it as ``[dp, pp, ep, cp, tp]``. A process group is a line
of that tensor: all ranks that differ in one coordinate only.

Which axis varies fastest decides which groups hold neighbouring ranks, and in a cluster
neighbouring ranks share a node. Tensor parallelism goes first because it sends the most,
most often and on the critical path (four all-reduces of the activations per block and
micro-batch, with nothing to overlap them), so it needs NVLink inside a node. The course's
default ``"tp-cp-ep-pp-dp"`` keeps one replica (a whole pipeline) a block of neighbouring
ranks, as chapter 05's ``(dp, pp)`` grid does. Megatron-LM's default,
:data:`MEGATRON_ORDER` = ``"tp-cp-ep-dp-pp"`` (``parallel_state.initialize_model_parallel``),
puts pp slowest instead: a pipeline's send/recv of one micro-batch's activations is its
smallest traffic and can cross the slowest links. The groups are slices either way.

``dist.new_group`` is a collective over the whole world: every rank must create every group,
even the ones it is not in, in the same order, or the ranks wait on each other forever.
:meth:`Mesh.build` does exactly that, once, and destroys every group it made when its
``with`` block ends (an error or an interrupted cell included), so multi-run launches do not
pile up communicators. Code then asks the mesh for a group by axis name and never falls back
to the default group::

    mesh = Mesh(dp=2, tp=2, pp=2)
    with mesh.build(timeout=30) as pm:
        dist.all_reduce(grad, group=pm.group("dp"))
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from parallel_lib.common.checks import check_int, positive_int, positive_number

__all__ = ["AXES", "DEFAULT_ORDER", "MEGATRON_ORDER", "Mesh", "RankMesh", "AxisSpec"]

AXES = ("dp", "pp", "ep", "cp", "tp")         # the index order of Mesh.ranks
DEFAULT_ORDER = "tp-cp-ep-pp-dp"              # fastest-varying axis first, as Megatron-LM writes orders
MEGATRON_ORDER = "tp-cp-ep-dp-pp"             # Megatron-LM's default: pp slowest

AxisSpec = Union[str, tuple[str, ...]]         # one axis, or several flattened into one group


@dataclass(frozen=True)
class Mesh:
    """A layout of ``dp * pp * ep * cp * tp`` ranks on named axes (no process groups: see :meth:`build`).

    Args:
        dp, pp, ep, cp, tp: size of each axis (1: absent).
        order: the axes, fastest-varying first, joined by ``-``; axes of size 1 may be left out
            (``"tp-dp-pp"`` is Megatron-LM's order for a mesh without cp and ep).

    Raises:
        ValueError: a size below 1, or an order that repeats an axis, names an unknown one or
            leaves out an axis of size > 1.
    """

    dp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for axis in AXES:
            positive_int(axis, getattr(self, axis))
        named = self.order.split("-") if isinstance(self.order, str) else []
        unnamed = [a for a in AXES if a not in named]
        if (not named or len(set(named)) != len(named) or set(named) - set(AXES)
                or any(getattr(self, a) > 1 for a in unnamed)):
            raise ValueError(f"order must name axes of {AXES} once each, fastest-varying first and joined by '-' "
                             f"(e.g. {DEFAULT_ORDER!r} or Megatron-LM's {MEGATRON_ORDER!r}), every axis of size > 1 "
                             f"among them, got order={self.order!r} for {self.sizes}")
        # an axis of size 1 changes no rank's place: the unnamed ones go last
        object.__setattr__(self, "order", "-".join(named + unnamed))

    @classmethod
    def of_world(cls, world_size: int, order: str = DEFAULT_ORDER, **sizes: int) -> Mesh:
        """The mesh whose unnamed ``dp`` axis takes what ``sizes`` leave of ``world_size``.

        Raises:
            ValueError: an unknown axis, or sizes whose product does not divide ``world_size``.
        """
        unknown = sorted(set(sizes) - set(AXES))
        if unknown:
            raise ValueError(f"unknown axis {unknown}; the axes are {AXES}")
        positive_int("world_size", world_size)
        fixed = 1
        for axis, size in sizes.items():
            fixed *= positive_int(axis, size)
        if "dp" in sizes:
            if fixed != world_size:
                raise ValueError(f"the axes {sizes} hold {fixed} ranks, not world_size={world_size}")
            return cls(order=order, **sizes)
        if world_size % fixed:
            raise ValueError(f"world_size={world_size} is not a multiple of {' x '.join(map(str, sizes.values()))}"
                             f" = {fixed} (the axes {sizes}); choose sizes whose product divides it")
        return cls(dp=world_size // fixed, order=order, **sizes)

    # ---- the layout ---------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.ep * self.cp * self.tp

    def size(self, axis: AxisSpec) -> int:
        """Ranks along ``axis`` (the product of the sizes, for several axes flattened)."""
        n = 1
        for a in _axes(axis):
            n *= getattr(self, a)
        return n

    @property
    def short_order(self) -> str:
        """``order`` without the axes of size 1 (they change no rank's place), e.g. ``"tp-pp-dp"``."""
        return "-".join(a for a in self.order.split("-") if getattr(self, a) > 1) or "dp"

    @property
    def sizes(self) -> dict[str, int]:
        """Every axis's size, in :data:`AXES` order."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def ranks(self) -> Tensor:
        """Global rank at every coordinate, indexed ``[dp, pp, ep, cp, tp]``."""
        fastest_first = self.order.split("-")
        slowest_first = fastest_first[::-1]
        grid = torch.arange(self.world_size).reshape([getattr(self, a) for a in slowest_first])
        return grid.permute([slowest_first.index(a) for a in AXES])

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on every axis.

        Raises:
            ValueError: a rank outside ``[0, world_size)``.
        """
        check_int("rank", rank, 0, self.world_size - 1)
        where = (self.ranks == rank).nonzero()[0].tolist()
        return dict(zip(AXES, where))

    def rank_at(self, **coords: int) -> int:
        """The global rank at these coordinates (an axis not given is at 0).

        Raises:
            ValueError: an unknown axis or a coordinate outside its axis.
        """
        unknown = sorted(set(coords) - set(AXES))
        if unknown:
            raise ValueError(f"unknown axis {unknown}; the axes are {AXES}")
        index = [check_int(a, coords.get(a, 0), 0, getattr(self, a) - 1) for a in AXES]
        return int(self.ranks[tuple(index)])

    def groups_of(self, axis: AxisSpec) -> list[list[int]]:
        """Every group along ``axis`` (lists of global ranks, in axis order), in the order they are created.

        Groups are listed by the coordinates of the other axes, :data:`AXES` order, last fastest.
        """
        along = _axes(axis)
        for a in along:
            _check_axis(a)
        others = [a for a in AXES if a not in along]
        ranks = self.ranks.permute([AXES.index(a) for a in others + list(along)])
        return ranks.reshape(-1, self.size(along)).tolist()

    def peers(self, axis: AxisSpec, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis``, in axis order (``rank`` among them)."""
        check_int("rank", rank, 0, self.world_size - 1)
        return next(g for g in self.groups_of(axis) if rank in g)

    def tied_groups(self) -> list[list[int]]:
        """First and last rank of every pipeline (GPT-2's tied embedding lives on both); empty when pp == 1."""
        if self.pp == 1:
            return []
        return [[g[0], g[-1]] for g in self.groups_of("pp")]

    def __str__(self) -> str:
        used = [a for a in AXES if getattr(self, a) > 1] or ["dp"]
        head = " x ".join(f"{a}={getattr(self, a)}" for a in used)
        lines = [f"{head} = {self.world_size} ranks, order {self.short_order}"]
        width = len(str(self.world_size - 1))
        inner = [a for a in used if a not in ("dp", "pp")]  # shown inside one stage's brackets
        for d in range(self.dp):
            stages = []
            for j in range(self.pp):
                block = self.ranks[d, j].flatten().tolist()
                stages.append((f"stage {j} " if self.pp > 1 else "") + "[" + " ".join(f"{r:>{width}}" for r in block)
                              + "]")
            lines.append((f"replica {d}: " if self.dp > 1 else "") + "   ".join(stages))
        if inner:
            lines.append(f"(inside brackets: {' x '.join(inner)}, last axis fastest)")
        return "\n".join(lines)

    # ---- process groups -----------------------------------------------------------------------------

    @contextmanager
    def build(self, timeout: float = 60.0, flatten: Iterable[Sequence[str]] = (),
              rank: Optional[int] = None) -> Iterator[RankMesh]:
        """Create every group of the mesh on this rank, yield this rank's view, destroy them all on exit.

        A collective over the default group: every rank of the world must enter it with the same
        mesh and ``flatten``. Groups are created axis by axis in :data:`AXES` order, then the
        flattened ones, then the tied (first, last) pair of every pipeline.

        Args:
            timeout: seconds any collective on these groups may wait.
            flatten: extra groups over several axes at once, e.g. ``[("dp", "cp")]`` (FSDP over data
                and context ranks).
            rank: this process's global rank (default: ``dist.get_rank()``).

        Raises:
            RuntimeError: torch.distributed is not initialised, or its world is not the mesh's.
        """
        positive_number("timeout", timeout)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Mesh.build needs an initialised process group: call it inside a rank started by "
                               "parallel_lib.runtime.launch (or under torchrun after init_process_group)")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"the mesh holds {self.world_size} ranks ({self}) but the world has "
                               f"{dist.get_world_size()}: launch world_size={self.world_size}")
        me = dist.get_rank() if rank is None else rank
        specs: list[AxisSpec] = [*AXES, *(tuple(f) if len(f) > 1 else f[0] for f in map(tuple, flatten))]
        for spec in specs:
            for a in _axes(spec):
                _check_axis(a)
        pm = RankMesh(self, me, timeout)
        try:
            wait = timedelta(seconds=timeout)
            for spec in specs:
                for ranks in self.groups_of(spec):
                    pm._adopt(spec, ranks, dist.new_group(ranks, timeout=wait))
            for ranks in self.tied_groups():
                pm._adopt("tied", ranks, dist.new_group(ranks, timeout=wait))
            yield pm
        finally:
            pm.destroy()


@dataclass(eq=False)
class RankMesh:
    """One rank's view of a built :class:`Mesh`: its coordinates and its process group on each axis."""

    mesh: Mesh
    rank: int
    timeout: float
    _groups: dict[AxisSpec, Any] = field(default_factory=dict, repr=False)
    _peers: dict[AxisSpec, list[int]] = field(default_factory=dict, repr=False)
    _made: list[Any] = field(default_factory=list, repr=False)
    _alive: bool = True

    def _adopt(self, spec: AxisSpec, ranks: list[int], group: Any) -> None:
        self._made.append(group)
        if self.rank in ranks:
            self._groups[spec] = group
            self._peers[spec] = ranks

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.rank)

    @property
    def groups_made(self) -> int:
        """How many process groups this rank created (and will destroy)."""
        return len(self._made)

    def group(self, axis: AxisSpec) -> Any:
        """This rank's process group along ``axis`` ("tied": first and last rank of its pipeline).

        Raises:
            ValueError: an axis (or flattened tuple) the mesh did not build, or "tied" when pp == 1.
            RuntimeError: the mesh's ``with`` block has ended (its groups are destroyed).
        """
        if not self._alive:
            raise RuntimeError("the mesh's groups were destroyed when its `with mesh.build(...)` block ended; "
                               "use them inside the block")
        key = _key(axis)
        if key not in self._groups:
            if key == "tied":
                raise ValueError("the tied group (first and last stage of a pipeline) exists only when pp > 1")
            if isinstance(key, str):
                _check_axis(key)
            raise ValueError(f"no group along {axis!r} was built: pass flatten=[{key!r}] to Mesh.build")
        return self._groups[key]

    def peers(self, axis: AxisSpec) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        self.group(axis)
        return list(self._peers[_key(axis)])

    def size(self, axis: AxisSpec) -> int:
        return self.mesh.size(axis)

    def index(self, axis: AxisSpec) -> int:
        """This rank's position in its group along ``axis``."""
        return self.peers(axis).index(self.rank)

    def destroy(self) -> None:
        """Destroy every group this rank created (idempotent)."""
        if not self._alive:
            return
        self._alive = False
        made, self._made = self._made, []
        self._groups.clear()
        if dist.is_available() and dist.is_initialized():
            for group in made:
                if group is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(group)


def _axes(axis: AxisSpec) -> tuple[str, ...]:
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) for a in axis):
        return tuple(axis)
    raise TypeError(f"an axis is one of {AXES} or a tuple of them, got {axis!r}")


def _key(axis: AxisSpec) -> AxisSpec:
    axes = _axes(axis)
    return axes[0] if len(axes) == 1 else axes


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; the axes are {AXES}")

