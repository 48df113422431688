"""Pipeline schedules as data: what each rank does, in order.

A schedule is, for every rank, the ordered list of its actions: ``F`` (forward of one
micro-batch through one model stage), ``B`` (backward: for a split backward only the
gradient of the stage's *input*, which the previous stage waits for) and ``W`` (the
gradient of the stage's *weights*, which nobody waits for, so it can fill idle time).
Each action names its micro-batch and, when a rank holds more than one model stage
(interleaved and V schedules), the model stage (``stage``). Nothing else: no clock,
no threads, no torch. Keeping it plain data lets one object drive every consumer,
so what a reader sees is what runs:

- :class:`parallel_lib.pipeline_parallel.Pipe` runs each rank's list in its worker thread;
- the ranks of :mod:`parallel_lib.pipeline_parallel.process` exchange tensors in its order;
- :func:`simulate` replays it with given costs; the animation in :mod:`parallel_lib.viz.schedule` draws that.

GPipe and 1F1B are the special case of one stage per rank (``stage`` None: the rank's own)
and no W (B is the whole backward). Generators for the others are in
:mod:`parallel_lib.pipeline_parallel.generators`; the rules every schedule must meet are
checked by :func:`validate_schedule` (:mod:`parallel_lib.pipeline_parallel.simulator`).

Letters used throughout: ``i`` micro-batch, ``j``/``r`` rank, ``s`` model stage, ``k`` clock
tick, ``m`` number of micro-batches, ``p`` number of ranks, ``v`` model stages per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Container, Iterator, Literal, Optional

from parallel_lib.common.checks import positive_int

__all__ = [
    "clock_cycles",
    "_clock_cycles",
    "Action",
    "Schedule",
    "SCHEDULES",
    "ALL_SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "make_schedule",
    "register_schedule",
    "stages_per_rank",
    "loop_placement",
    "v_placement",
    "validate_schedule",
    "simulate",
    "bubble_fraction",
    "stage_lane",
    "action_ready",
]

Kind = Literal["F", "B", "W"]
StageCost = tuple[float, float]  # (forward, backward) seconds or ticks; (F, B, W) triples in simulate
KIND_EVENTS = {"F": "forward", "B": "backward", "W": "backward"}  # W is drawn as backward, labelled "W"


@dataclass(frozen=True)
class Action:
    """One unit of work: ``F``/``B``/``W`` of micro-batch ``micro_batch`` on model stage ``stage``.

    ``stage`` None means the stage of the rank whose list holds the action (one stage per rank).
    """

    kind: Kind
    micro_batch: int
    stage: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "W"):
            raise ValueError(f"kind must be 'F', 'B' or 'W', got kind={self.kind!r}")

    @property
    def event_kind(self) -> str:
        """The :class:`parallel_lib.common.timeline.Event` kind of this action (W counts as backward)."""
        return KIND_EVENTS[self.kind]

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + ("" if self.stage is None else f"s{self.stage}")


def loop_placement(p: int, v: int) -> tuple[int, ...]:
    """Rank of each of the p·v model stages when stage s lives on rank ``s % p`` (Megatron's interleaving)."""
    return tuple(s % p for s in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """Rank of each of the 2p model stages in a V: down the ranks, then back up (ZBV, DualPipeV)."""
    return tuple(range(p)) + tuple(reversed(range(p)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions of one pipeline schedule.

    Attributes:
        name: e.g. "gpipe", "1f1b", "interleaved", "zb-h1" (or free-form for a hand-written one).
        num_stages: p, the number of ranks (lists); one model stage each unless ``placement`` says otherwise.
        num_micro_batches: m.
        stages: ``stages[r]`` is rank r's actions in the order it runs them.
        placement: ``placement[s]`` is the rank that holds model stage s; default one stage per rank.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    stages: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.placement:
            object.__setattr__(self, "placement", tuple(range(self.num_stages)))

    @property
    def num_model_stages(self) -> int:
        """How many pieces the model is cut into (p·v)."""
        return len(self.placement)

    @property
    def virtual(self) -> int:
        """v: model stages per rank."""
        return max(1, self.num_model_stages // max(1, self.num_stages))

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for actions in self.stages for a in actions)

    def stage_of(self, rank: int, action: Action) -> int:
        """The model stage ``action`` in rank ``rank``'s list works on."""
        return rank if action.stage is None else action.stage

    def forward_only(self) -> Schedule:
        """The same schedule without its backward actions (inference)."""
        return Schedule(f"{self.name} (forward)", self.num_stages, self.num_micro_batches,
                        tuple(tuple(a for a in actions if a.kind == "F") for actions in self.stages), self.placement)

    def __str__(self) -> str:
        who = "stage" if self.num_model_stages == self.num_stages else "rank"  # chapter 04 prints stages
        rows = [f"{who} {j}: " + " ".join(str(a) for a in actions) for j, actions in enumerate(self.stages)]
        return "\n".join([f"{self.name}, p={self.num_stages}, m={self.num_micro_batches}", *rows])


def clock_cycles(num_batches: int, num_partitions: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe's forward wavefront: the ``(i, j)`` pairs that run at each clock tick ``k``.

    Micro-batch i reaches partition j at tick ``k = i + j``: the pipeline fills for
    ``p - 1`` ticks, runs full, and drains for ``p - 1`` ticks, ``m + p - 1`` in all.
    """
    # i: micro-batch, j: partition, k: clock tick.  m = p = 3:
    #
    #   k | (i,j)  (i,j)  (i,j)
    #   --+--------------------
    #   0 | (0,0)
    #   1 | (1,0)  (0,1)
    #   2 | (2,0)  (1,1)  (0,2)
    #   3 |        (2,1)  (1,2)
    #   4 |               (2,2)
    for k in range(num_batches + num_partitions - 1):
        yield [(k - j, j) for j in range(max(0, k - num_batches + 1), min(k + 1, num_partitions))]


_clock_cycles = clock_cycles  # the name torchgpipe and the source article use


def _check_sizes(p: int, m: int) -> None:
    positive_int("p", p)
    positive_int("m", m)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every stage runs all m forwards, then all m backwards in reverse order.

    Each stage holds the activations of all m micro-batches at the turn from
    forward to backward.
    """
    _check_sizes(p, m)
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in reversed(range(m))]
    return Schedule("gpipe", p, m, tuple(tuple(forwards + backwards) for _ in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward / one backward, then cool-down.

    Stage j first runs ``w = min(p - 1 - j, m)`` warm-up forwards, then alternates
    ``F(w + n)``, ``B(n)`` while forwards remain, then runs the remaining backwards.
    It therefore holds at most ``p - j <= p`` micro-batches' activations, instead of
    GPipe's m, at the same bubble when forward and backward costs are balanced.
    """
    _check_sizes(p, m)
    stages = []
    for j in range(p):
        warmup = min(p - 1 - j, m)
        actions = [Action("F", i) for i in range(warmup)]
        for n in range(m - warmup):  # steady state: one forward in, one backward out
            actions += [Action("F", warmup + n), Action("B", n)]
        actions += [Action("B", i) for i in range(m - warmup, m)]  # cool-down
        stages.append(tuple(actions))
    return Schedule("1f1b", p, m, tuple(stages))


# the schedules every engine runs with one stage per rank (chapters 04 and 05)
SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
# every named schedule: name -> (generator(p, m), model stages per rank); generators.py adds chapter 08's
ALL_SCHEDULES: dict[str, tuple[Callable[[int, int], Schedule], int]] = {"gpipe": (gpipe, 1),
                                                                       "1f1b": (one_f_one_b, 1)}


def register_schedule(name: str, generator: Callable[[int, int], Schedule], virtual: int = 1) -> None:
    """Make ``make_schedule(name, p, m)`` call ``generator(p, m)`` (v model stages per rank)."""
    ALL_SCHEDULES[name] = (generator, virtual)


def stages_per_rank(name: str) -> int:
    """v of the named schedule (2 for interleaved and V schedules, else 1)."""
    _known(name)
    return ALL_SCHEDULES[name][1]


def _known(name: str) -> None:
    import parallel_lib.pipeline_parallel.generators  # noqa: F401  (registers chapter 08's schedules)
    if name not in ALL_SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(ALL_SCHEDULES)}, got schedule={name!r}")


def make_schedule(name: str, p: int, m: int) -> Schedule:
    """The schedule called ``name`` (see :data:`ALL_SCHEDULES`) for p ranks and m micro-batches.

    Raises:
        ValueError: an unknown name, p, m not an int of at least 1, or an m the schedule cannot run with.
    """
    _known(name)
    _check_sizes(p, m)  # every schedule, before its generator does arithmetic on them
    return ALL_SCHEDULES[name][0](p, m)


def stage_lane(j: int) -> str:
    """Timeline lane of rank (stage) j, shared by measured and simulated runs."""
    return f"stage {j}"


Done = Container[tuple[str, int, int]]  # finished (kind, model stage, micro-batch)


def action_ready(schedule: Schedule, j: int, action: Action, done: Done) -> bool:
    """Whether rank j may start ``action`` once ``done`` holds the finished (kind, model stage, i).

    F(i, s) needs F(i, s-1); B(i, s) needs F(i, s) and B(i, s+1); W(i, s) needs B(i, s).
    """
    i, s = action.micro_batch, schedule.stage_of(j, action)
    if action.kind == "F":
        return s == 0 or ("F", s - 1, i) in done
    if action.kind == "W":
        return ("B", s, i) in done
    return ("F", s, i) in done and (s + 1 == schedule.num_model_stages or ("B", s + 1, i) in done)


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B pipeline with equal stage costs: ``(p - 1) / (m + p - 1)``."""
    _check_sizes(p, m)
    return (p - 1) / (m + p - 1)


from parallel_lib.pipeline_parallel.simulator import simulate, validate_schedule  # noqa: E402  (they use the above)
