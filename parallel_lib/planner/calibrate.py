"""How fast this machine computes and communicates: the planner's calibration, measured and cached.

A prediction of step time needs four kinds of numbers, all measured here in a few seconds:

- **compute**: the matmul FLOP/s and memory bandwidth of one rank
  (:func:`parallel_lib.common.machine_speed.measure_machine_speed`), measured *while the other
  ranks of the same world measure too*: on a 2-core laptop, 4 ranks share 2 cores, and a rank
  computes at half the rate it would alone; and one model step timed on every rank at once
  against the same step in one process alone, which scales the model's step cost (below);
- **a model's step**: a CPU reaches the 512 × 512 matmul rate only on large matrices; a GPT-2 step
  of a small model spends much of its time outside matrix products (kernel dispatch, autograd,
  layer norms, the optimizer). :func:`fit_step_cost` times one rank's forward + backward, through the
  training entry's own code, at four batch sizes and splits it into a fixed cost per block and micro-batch and a FLOP rate;
- **communication**: an α–β fit per collective — all-reduce, reduce-scatter, all-gather and
  send/recv — of ``t = hops·α + wire_bytes/β`` (hops: ring steps; wire bytes: what one rank
  sends, :mod:`parallel_lib.cost.alpha_beta`, the course's one α–β model), timed on this machine's gloo ranks
  the way a step runs them: each call after a short piece of compute whose length differs a little
  between ranks (:mod:`parallel_lib.planner.interleaved`), so α holds the wait for the slowest rank
  and for a waiting process to be scheduled again, which collectives run back to back never pay;
  and the all-reduce of tensor-parallel pairs timed inside real split steps of the model
  (:func:`inside_step_fit`), which a layout's tensor-parallel collectives are priced with;
- bubbles come from the schedule simulator, not from here.

``python -m parallel_lib.planner calibrate`` runs it and caches the result per machine
(:mod:`parallel_lib.planner.calibration_cache`), never in the repository. On GPUs,
:mod:`parallel_lib.planner.hardware` gives published figures instead.

A calibration read back is checked number by number (:meth:`Calibration.from_json`: finite, rates
and bandwidths > 0, latencies and fixed costs >= 0), so a cache someone truncated or edited is
named instead of failing later as a ``ZeroDivisionError`` in the planner.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_choice, check_int
from parallel_lib.common.machine_speed import measure_machine_speed
from parallel_lib.cost.alpha_beta import KINDS, AlphaBeta, fit_alpha_beta, hops
from parallel_lib.planner.interleaved import Action, World, compute_pieces, dist_world, fit_interleaved
from parallel_lib.runtime.compat import all_gather_single, reduce_scatter_single
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.launcher import launch
from parallel_lib.runtime.timed_collectives import timed_collectives

__all__ = ["KINDS", "AlphaBeta", "RankSpeed", "Calibration", "hops", "fit_alpha_beta", "collective_worker",
           "calibrate", "check_world_sizes", "machine_key"]
SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21)  # 4 KiB .. 2 MiB: latency- to bandwidth-bound


@dataclass(frozen=True)
class RankSpeed:
    """What one rank of a ``world_size``-rank world measured while the others measured too."""

    world_size: int
    flops_per_second: float     # 512 x 512 fp32 matmul, one thread
    bytes_per_second: float     # copy of a 64 MiB buffer
    links: dict = field(default_factory=dict)  # kind -> AlphaBeta (over all world_size ranks)
    step_costs: dict = field(default_factory=dict)  # model key -> (fixed, FLOP/s, optimizer, forward share),
    #                                                 model_step.fit_step_cost
    step_times: dict = field(default_factory=dict)  # model key -> seconds of one PROBE_BATCH step, every rank at once
    inside: dict = field(default_factory=dict)  # kind -> AlphaBeta in tensor-parallel pairs, timed inside real steps

    def seconds(self, kind: str, nbytes: float, group_size: int) -> float:
        return self.links[kind].seconds(kind, nbytes, group_size) if group_size > 1 else 0.0


def _collective(kind: str, nbytes: int, rank: int, world_size: int, device: torch.device) -> Action:
    """One call of ``kind`` over every rank with a message of ``nbytes`` (as the counter records it), on ``device``."""
    n = nbytes // 4
    x = torch.ones(n, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "reduce_scatter":
        out = torch.empty(max(n // world_size, 1), device=device)
        return lambda: reduce_scatter_single(out, x[:out.numel() * world_size])
    if kind == "all_gather":  # the counter records the gathered size: time that message
        part = torch.ones(max(n // world_size, 1), device=device)
        out = torch.empty(part.numel() * world_size, device=device)
        return lambda: all_gather_single(out, part)
    # a ring of sends: every rank sends to the next and receives from the previous
    peer_to, peer_from = (rank + 1) % world_size, (rank - 1) % world_size
    buf = torch.empty(n, device=device)
    return lambda: [w.wait() for w in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, x, peer_to), dist.P2POp(dist.irecv, buf, peer_from)])]


def collective_worker(rank: int, world_size: int, sizes: Sequence[int] = SIZES, repeats: int = 5,
                      alone: Optional["Calibration"] = None) -> RankSpeed:
    """One rank of the calibration launch: compute rates (all ranks at once), then each collective's fit.

    Each collective is timed between pieces of compute (:func:`~parallel_lib.planner.interleaved.fit_interleaved`)
    at every message size in ``sizes``, ``repeats`` times.

    A model's step is fitted once, in one process alone (two parameters need quiet measurements);
    at ``world_size`` ranks it is slowed by the ratio of the matmul rates measured here
    (:meth:`Calibration.step_cost`). Every tensor handed to a collective lives on the device the
    launch gave this rank (:func:`~parallel_lib.runtime.device.rank_device`: its GPU under NCCL,
    the CPU under gloo); the compute rates and the model's step are the CPU's.
    """
    device = rank_device()
    torch.set_num_threads(1)
    dist.barrier()
    speed = measure_machine_speed("cpu", size=512, megabytes=32, repeats=repeats)
    from parallel_lib.planner.model_step import time_step  # model_step builds on this module

    # a model step on every rank at once, against the same step in one process alone
    models = sorted(alone.ranks[1].step_times) if alone is not None else []
    numbers = torch.tensor([speed.flops_per_second, speed.bytes_per_second], dtype=torch.float64, device=device)
    dist.all_reduce(numbers)  # the mean rank's rates
    numbers /= world_size
    # the slowest rank's step: a layout's step waits for it at its first collective (4 ranks on 2 cores: DP4's
    # ranks computed in 26-31 ms beside each other, and the others waited for the slowest in their all-reduce)
    slowest = torch.tensor([time_step(*_model_of(key), repeats=repeats) for key in models] or [0.0],
                           dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    numbers = torch.cat([numbers, slowest])
    steps, step_times = {}, {}
    for k, key in enumerate(models):
        assert alone is not None
        slow = float(numbers[2 + k]) / alone.ranks[1].step_times[key]
        fixed, rate, optimizer, forward = alone.ranks[1].step_costs[key]
        steps[key], step_times[key] = (fixed * slow, rate / slow, optimizer * slow, forward), float(numbers[2 + k])
    # each collective between pieces of compute, as a step runs it (planner.interleaved)
    pieces, world = compute_pieces(rank, device=device), dist_world(device)
    links = {kind: fit_interleaved(kind, world_size, sizes, lambda nbytes, kind=kind: _collective(
        kind, nbytes, rank, world_size, device), pieces, repeats, world) for kind in KINDS}
    inside = inside_step_fit(rank, world_size, models[0], repeats, world) if models else {}
    return RankSpeed(world_size, float(numbers[0]), float(numbers[1]), links, steps, step_times, inside)


PAIR = 2  # the tensor-parallel groups timed inside a step: neighbouring ranks, tp fastest (the runtime's mesh order)


def inside_step_fit(rank: int, world_size: int, key: str, repeats: int, world: World) -> dict[str, AlphaBeta]:
    """Tensor-parallel pairs' α–β, fitted to the calls of real training steps: all-reduce, and sequence
    parallelism's all-gather and reduce-scatter.

    Every pair of neighbouring ranks runs model ``key``'s forward + backward split over the pair
    (:func:`~parallel_lib.planner.model_step.entry_step`), all pairs at once, at three batch sizes, without
    and with sequence parallelism; each collective is timed where it is called
    (:func:`~parallel_lib.runtime.timed_collectives.timed_collectives`). The fit takes, per message size, the mean call (a step pays every call, the slow ones too: a
    partner that arrived late, a rank not scheduled yet), the slowest rank's. Tensor parallelism's
    collectives sit between short, uneven pieces of Python and kernels; the pieces of
    :func:`~parallel_lib.planner.interleaved.fit_interleaved` are single matrix products, and on this
    2-core machine their fit priced a tp = 2 step's all-reduces at 17.6 ms where the step spent 26 ms in
    them; among 4 ranks the ring of 4's fit priced DP2 × TP2's and TP2 × PP2's at 1.1–1.9 times what
    their steps spent (issue #21).

    Returns:
        ``{kind: AlphaBeta}`` for the three kinds, or ``{}`` when ``world_size`` is odd (no pairs to form).
    """
    from parallel_lib.planner.model_step import PROBE_BATCH, entry_step  # model_step builds on this module

    if world_size % PAIR:
        return {}
    pairs = [dist.new_group(list(range(r, r + PAIR))) for r in range(0, world_size, PAIR)]  # every rank, every group
    samples: dict[str, dict[int, list[float]]] = {kind: {} for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    for sequence_parallel, kinds in ((False, ("all_reduce",)), (True, ("all_gather", "reduce_scatter"))):
        with entry_step(*_model_of(key), group=pairs[rank // PAIR], sequence_parallel=sequence_parallel) \
                as (seconds, _):
            for batch in (PROBE_BATCH // 2, PROBE_BATCH, 2 * PROBE_BATCH):
                seconds(batch)  # a warm-up at each size: buffers, gloo's pairs
                world.barrier()
                with timed_collectives() as calls:
                    for _ in range(2 * repeats):  # a mean over heavy tails: twice the samples of a median
                        seconds(batch)
                for kind, nbytes, start, end in calls:
                    if kind in kinds:
                        samples[kind].setdefault(nbytes, []).append(end - start)
    for group in pairs:
        dist.destroy_process_group(group)
    fits = {}
    for kind, by_size in samples.items():
        sizes = sorted(by_size)
        means = world.slowest([statistics.mean(by_size[n]) for n in sizes])
        fits[kind] = fit_alpha_beta(kind, PAIR, [float(n) for n in sizes], means)
    return fits


def _model_of(key: str) -> tuple[str, int, int]:
    """``(size, vocabulary, sequence length)`` back from :func:`~parallel_lib.planner.model_step.step_key`."""
    name, vocab, seq = key.rsplit("-", 2)
    return name, int(vocab[1:]), int(seq[1:])


@dataclass(frozen=True)
class Calibration:
    """This machine's numbers, per world size (1 = one process alone), plus fitted model step costs."""

    machine: str
    ranks: dict                 # world_size -> RankSpeed
    gpus_per_node: int = 0      # 0: one machine; else groups spanning more ranks use ``across``
    across: dict = field(default_factory=dict)      # kind -> AlphaBeta between nodes

    def at(self, world_size: int) -> RankSpeed:
        """The measured world size closest to ``world_size`` from above (more ranks share cores), else the largest."""
        sizes = sorted(self.ranks)
        above = [n for n in sizes if n >= world_size]
        return self.ranks[above[0] if above else sizes[-1]]

    def step_cost(self, key: str, world_size: int) -> tuple[float, float, float, float]:
        """``(fixed, FLOP/s, optimizer, forward share)`` of model ``key`` on a rank of ``world_size``: measured
        there, or measured alone and slowed by the ratio of the matmul rates."""
        speed = self.at(world_size)
        if key in speed.step_costs:
            return tuple(speed.step_costs[key])  # type: ignore[return-value]
        alone = self.ranks[min(self.ranks)]
        if key not in alone.step_costs:
            raise ValueError(f"the calibration of {self.machine!r} has no step cost for {key!r}; calibrate with it")
        slow = alone.flops_per_second / speed.flops_per_second
        fixed, rate, optimizer, forward = alone.step_costs[key]
        return fixed * slow, rate / slow, optimizer * slow, forward

    def slowed(self, world_size: int, factor: float) -> "Calibration":
        """A copy whose ranks at ``world_size`` compute ``factor`` times slower (a busier moment of the machine)."""
        speed = self.at(world_size)
        steps = {k: (f * factor, r / factor, o * factor, share) for k, (f, r, o, share) in speed.step_costs.items()}
        ranks = dict(self.ranks)
        ranks[speed.world_size] = RankSpeed(speed.world_size, speed.flops_per_second / factor, speed.bytes_per_second,
                                            speed.links, steps, {k: t * factor for k, t in speed.step_times.items()},
                                            speed.inside)
        return Calibration(self.machine, ranks, self.gpus_per_node, self.across)

    def link(self, kind: str, world_size: int, span: int, inside_step: bool = False) -> AlphaBeta:
        """The α–β of ``kind`` in a job of ``world_size`` ranks for a group ``span`` consecutive ranks wide.

        ``inside_step``: a tensor-parallel group's collectives, between a step's layers; a pair
        (:data:`PAIR`) takes the fit to a real step's calls (:func:`inside_step_fit`) where the
        calibration has one.

        A group one rank wide never communicates: a free link, even in a calibration of one process
        alone (which has no collective fit: the benchmark prices one device with it).

        Raises:
            ValueError: a wider group in a world size the calibration has no collective fit for.
        """
        if span <= 1:
            return AlphaBeta(0.0, math.inf)
        if self.gpus_per_node and span > self.gpus_per_node:
            return self.across[kind]
        speed = self.at(world_size)
        if not speed.links:
            raise ValueError(f"the calibration of {self.machine!r} has no collective fit for {world_size} rank(s); "
                             "calibrate with that world size")
        if inside_step and span == PAIR and kind in speed.inside:
            return speed.inside[kind]
        return speed.links[kind]

    def to_json(self) -> str:
        ranks = {str(n): dict(world_size=r.world_size, flops_per_second=r.flops_per_second,
                              bytes_per_second=r.bytes_per_second,
                              links={k: asdict(v) for k, v in r.links.items()}, step_costs=r.step_costs,
                              step_times=r.step_times, inside={k: asdict(v) for k, v in r.inside.items()})
                 for n, r in self.ranks.items()}
        return json.dumps(dict(machine=self.machine, ranks=ranks), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        """The calibration :meth:`to_json` wrote, every number checked.

        Raises:
            ValueError: not JSON, a missing or unexpected key, or a number that is not finite or out of
                its range (a rate or bandwidth <= 0, a latency or a fixed cost < 0), naming where it is.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not valid JSON ({error})") from None
        if not isinstance(data, dict) or not isinstance(data.get("machine"), str) \
                or not isinstance(data.get("ranks"), dict) or not data["ranks"]:
            raise ValueError("expected an object with a 'machine' name and a non-empty 'ranks' object")
        ranks = {}
        for n, r in data["ranks"].items():
            where = f"ranks[{n!r}]"
            if not (isinstance(n, str) and n.isdigit() and int(n) >= 1 and isinstance(r, dict)):
                raise ValueError(f"{where}: expected a world size >= 1 and an object")
            links, inside = _field(r, "links", dict, where), _field(r, "inside", dict, where, {})
            for name, fits in (("links", links), ("inside", inside)):
                for kind, v in fits.items():
                    check_choice(f"{where}.{name} kind", kind, KINDS)
                    if not isinstance(v, dict) or set(v) != {"alpha", "bandwidth"}:
                        raise ValueError(f"{where}.{name}[{kind!r}]: expected {{'alpha': ..., 'bandwidth': ...}}, "
                                         f"got {v!r}")
            step_costs = _field(r, "step_costs", dict, where, {})
            for key, v in step_costs.items():
                if not isinstance(v, list) or len(v) != 4:
                    raise ValueError(f"{where}.step_costs[{key!r}]: expected [fixed, FLOP/s, optimizer, forward share], "
                                     f"got {v!r}")
            speed = RankSpeed(_field(r, "world_size", int, where), _field(r, "flops_per_second", float, where),
                              _field(r, "bytes_per_second", float, where),
                              {k: AlphaBeta(v["alpha"], v["bandwidth"]) for k, v in links.items()},
                              {k: tuple(v) for k, v in step_costs.items()},
                              dict(_field(r, "step_times", dict, where, {})),
                              {k: AlphaBeta(v["alpha"], v["bandwidth"]) for k, v in inside.items()})
            if speed.world_size != int(n):
                raise ValueError(f"{where}: world_size={speed.world_size} is not its key {n}")
            _check_speed(speed, where)
            ranks[int(n)] = speed
        return cls(data["machine"], ranks)


def _field(r: dict, key: str, kind: type, where: str, default: Any = None) -> Any:
    """``r[key]`` of type ``kind`` (an int is a float too, a bool is neither), or ``default`` when absent."""
    if key not in r and default is not None:
        return default
    value = r.get(key)
    ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {value!r}")
    return value


def _check_speed(speed: RankSpeed, where: str) -> None:
    """Every number of one world size: finite; rates, bandwidths and times > 0; latencies and fixed costs >= 0."""
    def number(name: str, value: Any, positive: bool) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (value <= 0 if positive else value < 0):
            raise ValueError(f"{where}.{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")

    number("flops_per_second", speed.flops_per_second, True)
    number("bytes_per_second", speed.bytes_per_second, True)
    for name, fits in (("links", speed.links), ("inside", speed.inside)):
        for kind, ab in fits.items():
            number(f"{name}[{kind!r}].alpha", ab.alpha, False)
            number(f"{name}[{kind!r}].bandwidth", ab.bandwidth, True)
    for key, (fixed, rate, optimizer, forward) in speed.step_costs.items():
        number(f"step_costs[{key!r}] fixed", fixed, False)
        number(f"step_costs[{key!r}] FLOP/s", rate, True)
        number(f"step_costs[{key!r}] optimizer", optimizer, False)
        number(f"step_costs[{key!r}] forward share", forward, True)
        if forward >= 1:
            raise ValueError(f"{where}.step_costs[{key!r}] forward share must be < 1, got {forward!r}")
    for key, seconds in speed.step_times.items():
        number(f"step_times[{key!r}]", seconds, True)


def machine_key(threads: int = 1) -> str:
    """Host name, torch version and threads per rank: a calibration holds for exactly these."""
    return f"{platform.node() or 'host'}-torch{torch.__version__}-t{threads}"


MODELS = (("tiny", 512, 64),)  # (GPT-2 size, vocabulary, sequence length) whose step the calibration times


def check_world_sizes(world_sizes: Any) -> tuple[int, ...]:
    """The world sizes a calibration measures besides one process alone (always measured): ints >= 2.

    An empty list measures one process alone only (the benchmark's quick run).

    Raises:
        ValueError: not a list, or a size that is not an int >= 2.
    """
    if isinstance(world_sizes, (str, bytes)) or not isinstance(world_sizes, Sequence):
        raise ValueError(f"world_sizes must be a list of ints >= 2, got {world_sizes!r}")
    return tuple(check_int("world size", n, minimum=2, hint="1 (one process alone) is always measured; "
                           "collectives need 2 ranks or more") for n in world_sizes)


def calibrate(world_sizes: Sequence[int] = (2, 4), repeats: int = 5, models: Sequence[tuple[str, int, int]] = MODELS,
              timeout: float = 120.0) -> Calibration:
    """Measure one process alone and every world size in ``world_sizes`` (one ``launch`` each).

    Raises:
        ValueError: a world size that is not an int >= 2 (before anything is measured).
    """
    from parallel_lib.planner.model_step import fit_step_cost, step_key, time_step

    world_sizes = check_world_sizes(world_sizes)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = measure_machine_speed("cpu", size=512, megabytes=32, repeats=repeats)
    finally:
        torch.set_num_threads(threads)
    steps, step_times = {}, {}
    for model in models:
        fit = fit_step_cost(*model, repeats=repeats)  # type: ignore[misc]
        steps[step_key(*model)] = (fit.fixed, fit.flops_per_second, fit.optimizer, fit.forward)
        step_times[step_key(*model)] = time_step(*model, repeats=repeats)  # type: ignore[misc]
    ranks = {1: RankSpeed(1, alone.flops_per_second, alone.bytes_per_second, {}, steps, step_times)}
    single = Calibration(machine_key(), dict(ranks))
    for n in world_sizes:
        ranks[n] = launch(collective_worker, n, SIZES, repeats, single,
                                                      threads_per_rank=1, timeout=timeout)[0]
    return Calibration(machine_key(), ranks)
