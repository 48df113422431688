"""Five ways to serve the same requests, each giving the single engine's tokens.

==========  =============================================================================
single      one process, one device: :class:`~parallel_lib.inference.engine.Engine`
dp          a replica per rank; the requests partitioned (chapter 01's rule), results in order
mp          the layers over ``world_size`` devices of one process (chapter 03's device map)
pp          a stage per rank, several request groups in flight (:mod:`.pipeline`)
tp          every layer split by heads over the ranks, the KV cache too (chapter 07)
==========  =============================================================================

:func:`serve` checks everything it can before any rank starts, runs the strategy (through
:func:`parallel_lib.runtime.launcher.run`, so under ``torchrun`` too) and returns a
:class:`ServeRun`: the results in request order and, per rank or device, its KV-cache and
weight bytes (tensor census), its timeline events and (tp) its collectives per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_choice, check_int, check_number, positive_int
from parallel_lib.common.models import build_gpt2, gpt2_config
from parallel_lib.common.timeline import Event
from parallel_lib.data.partition import partition_lengths
from parallel_lib.inference.batch import Request, Result, check_requests
from parallel_lib.inference.engine import Engine
from parallel_lib.inference.pipeline import run_pipeline_stage
from parallel_lib.inference.stage import build_stage
from parallel_lib.model_parallel.device_map import get_device_map
from parallel_lib.models.hf import as_gpt2
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.launcher import is_torchrun, run
from parallel_lib.runtime.mesh import Mesh
from parallel_lib.tensor_parallel.split import check_divisible

__all__ = ["STRATEGIES", "ServeConfig", "RankReport", "ServeRun", "check_serve", "serve", "serve_many", "serve_worker"]

STRATEGIES = ("single", "dp", "mp", "pp", "tp")
IN_PROCESS = ("single", "mp")


@dataclass(frozen=True)
class ServeConfig:
    """What every rank builds: the model (by size, vocabulary, seed) and the serving limits.

    Attributes:
        model, vocab_size, seed: :func:`parallel_lib.common.models.build_gpt2`'s arguments.
        initializer_range: the weights' init std (0.02 is GPT-2's; the tests take a larger one, whose
            random model does not just repeat its last token).
        max_batch: requests served at once per engine (the KV cache's batch).
        groups: pp only: request groups in flight (0: one per stage).
    """

    model: str = "tiny"
    vocab_size: int = 97
    seed: int = 0
    initializer_range: float = 0.02
    max_batch: int = 8
    groups: int = 0

    def build(self) -> Any:
        return build_gpt2(self.model, self.vocab_size, self.seed, initializer_range=self.initializer_range).eval()

    def config(self) -> Any:
        return gpt2_config(self.model, self.vocab_size, initializer_range=self.initializer_range)


@dataclass
class RankReport:
    """One rank's or device's share: bytes it holds (tensor census) and what it did when.

    Attributes:
        lane: the rank or device ("rank 1", "stage 0", "device 2").
        kv_bytes, weight_bytes: the storage of its KV cache(s) and of its parameters.
        events: its work, one event per group and step (``micro_batch`` = the group's number).
        collectives: tp: ``(step, all-reduce calls, all calls)`` per forward pass on this rank.
        groups: the request indices of each group it served, by group number.
    """

    lane: str
    kv_bytes: int
    weight_bytes: int
    events: list[Event] = field(default_factory=list)
    collectives: list[tuple[int, int, int]] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)


@dataclass
class ServeRun:
    """The results in request order, one :class:`RankReport` per rank/device, the wall time."""

    strategy: str
    world_size: int
    results: list[Result]
    ranks: list[RankReport]
    seconds: float

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.results]

    @property
    def events(self) -> list[Event]:
        """Every request's events and every rank's, on one time axis per rank."""
        return [e for r in self.results for e in r.events] + [e for rank in self.ranks for e in rank.events]

    def tokens_per_second(self) -> float:
        return sum(len(r.tokens) for r in self.results) / self.seconds if self.seconds > 0 else float("nan")


def _weight_bytes(module: torch.nn.Module) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


def check_serve(strategy: str, world_size: int, requests: Any, config: ServeConfig) -> list[Request]:
    """Every check that needs no rank: the strategy, the world size against the model, the requests.

    Raises:
        ValueError: an unknown strategy; a world size that is not 1 for ``single``, exceeds the layers
            for ``mp``/``pp`` or does not divide the heads for ``tp``; bad requests (see
            :func:`~parallel_lib.inference.batch.check_requests`); a bad ``max_batch``, ``groups`` or
            ``initializer_range`` (NaN, infinite or negative: every weight would be NaN or meaningless).
        TypeError: ``config`` is not a :class:`ServeConfig`, or bad requests.
    """
    check_choice("strategy", strategy, STRATEGIES)
    positive_int("world_size", world_size)
    if not isinstance(config, ServeConfig):
        raise TypeError(f"config must be a ServeConfig, got {type(config).__name__}")
    positive_int("max_batch", config.max_batch)
    check_int("groups", config.groups, minimum=0, hint="0 puts one group per pipeline stage in flight")
    check_number("initializer_range", config.initializer_range, 0.0, hint="GPT-2's is 0.02")
    model = config.config()
    if strategy == "single" and world_size != 1:
        raise ValueError(f"strategy='single' runs on one device, got world_size={world_size}; use dp, mp, pp or tp")
    if strategy in ("mp", "pp") and world_size > model.n_layer:
        raise ValueError(f"strategy={strategy!r} needs a layer per device: world_size={world_size} > n_layer="
                         f"{model.n_layer}; use at most {model.n_layer}")
    if strategy == "tp":
        check_divisible("n_head", model.n_head, world_size, hint="choose a world size that divides the number of heads")
    return check_requests(requests, model.n_positions)


def serve(requests: Sequence[Request], strategy: str = "single", world_size: int = 1,
          config: ServeConfig = ServeConfig(), **launch_kwargs: Any) -> ServeRun:
    """Serve ``requests`` with ``strategy`` on ``world_size`` ranks or devices (see the module docstring).

    Args:
        requests: the requests (the same list reaches every rank).
        strategy: one of :data:`STRATEGIES`.
        world_size: ranks (dp, pp, tp) or devices (mp; int keys: GPUs, or the CPU without).
        config: the model and limits.
        **launch_kwargs: ``timeout``, ``threads_per_rank``, ``backend`` ... for the launcher.

    Raises:
        ValueError, TypeError: see :func:`check_serve`; nothing has started then.
        RankError: a rank failed (naming it).
    """
    return serve_many(requests, [strategy], world_size, config, **launch_kwargs)[strategy]


def serve_many(requests: Sequence[Request], strategies: Sequence[str], world_size: int,
               config: ServeConfig = ServeConfig(), **launch_kwargs: Any) -> dict[str, ServeRun]:
    """Several strategies on the same requests, the ranked ones (dp, pp, tp) in ONE launch.

    Starting ranks costs seconds (each imports torch); the ranks here run the strategies one after
    another. ``ServeRun.seconds`` is the time serving took (on ranks the slowest rank's, between two
    barriers), never the start-up or building the model. ``single`` always runs on one device.

    Raises:
        ValueError, TypeError: see :func:`check_serve`, for any of the strategies; nothing has started then.
    """
    if isinstance(strategies, str) or not strategies:
        raise ValueError(f"strategies must be a non-empty list of names from {STRATEGIES}, got {strategies!r}")
    for strategy in strategies:
        requests = check_serve(strategy, 1 if strategy == "single" else world_size, requests, config)
    runs: dict[str, ServeRun] = {}
    for strategy in strategies:
        if strategy in IN_PROCESS:
            size = 1 if strategy == "single" else world_size
            results, reports, seconds = serve_worker(0, 1, strategy, requests, config, size)
            runs[strategy] = ServeRun(strategy, size, results, reports, seconds)
    ranked = [s for s in strategies if s not in IN_PROCESS]
    if ranked:
        timeout = launch_kwargs.setdefault("timeout", 60.0)  # the launch's and each wait's limit
        per_rank = run(_ranked_worker, None if is_torchrun() else world_size, ranked, requests, config, timeout,
                       **launch_kwargs)
        for strategy in ranked:
            merged = {r.index: r for out in per_rank for r in out[strategy][0]}
            missing = [i for i in range(len(requests)) if i not in merged]
            if missing:
                raise RuntimeError(f"strategy={strategy!r}: no rank returned requests {missing}")
            runs[strategy] = ServeRun(strategy, len(per_rank), [merged[i] for i in range(len(requests))],
                                      [rep for out in per_rank for rep in out[strategy][1]],
                                      max(out[strategy][2] for out in per_rank))
    return {s: runs[s] for s in strategies}


def _ranked_worker(rank: int, world_size: int, strategies: list[str], requests: list[Request], config: ServeConfig,
                   timeout: float) -> dict[str, tuple[list[Result], list[RankReport], float]]:
    """Each strategy in turn on this rank."""
    return {s: serve_worker(rank, world_size, s, requests, config, world_size, timeout) for s in strategies}


def _timed(work: Callable[[], Any], ranked: bool) -> tuple[Any, float]:
    """``work()`` and the seconds it took; for a ``ranked`` strategy between barriers, so the slowest
    rank's time is everyone's (an in-process one may run on one rank while the others wait elsewhere)."""
    if ranked:
        dist.barrier()
    start = time.perf_counter()
    out = work()
    if ranked:
        dist.barrier()
    return out, time.perf_counter() - start


def serve_worker(rank: int, world_size: int, strategy: str, requests: list[Request], config: ServeConfig,
                 devices: int = 1, timeout: float = 60.0) -> tuple[list[Result], list[RankReport], float]:
    """One rank's work (``launch``/torchrun call it as ``fn(rank, world_size, *args)``); in-process for single/mp.

    Returns:
        ``(results this rank reports, [RankReport per device it drives], seconds)``: the seconds of
        serving only (building the model and the stages is not counted).
    """
    model = as_gpt2(config.build())  # the one GPT-2, converted once; every stage copies its own parts
    n_layer = model.config.n_layer
    if strategy in IN_PROCESS:
        engine = Engine.model_parallel(model, list(range(devices if strategy == "mp" else 1)),
                                       *_cache_size(requests, config))
        results, seconds = _timed(lambda: engine.generate(requests), ranked=False)
        return results, _reports(engine), seconds
    device = rank_device()
    if strategy == "dp":
        sizes = partition_lengths(len(requests), [1 / world_size] * world_size)
        first = sum(sizes[:rank])
        mine = range(first, first + sizes[rank])
        engine = Engine.model_parallel(model, [device], *_cache_size([requests[i] for i in mine], config))
        engine.stages[0].lane = f"rank {rank}"
        results, seconds = _timed(lambda: engine.generate([requests[i] for i in mine], list(mine)) if mine else [],
                                  ranked=True)
        return results, _reports(engine), seconds
    if strategy == "tp":
        stage = build_stage(model, range(n_layer), device, first=True, last=True, tp=True, lane=f"rank {rank}")
        rows, slots = _cache_size(requests, config)
        engine = Engine([stage], rows, model.config.n_positions, model.config.vocab_size, slots,
                        count_collectives=True)
        results, seconds = _timed(lambda: engine.generate(requests), ranked=True)
        return (results if rank == 0 else []), _reports(engine), seconds
    layers = get_device_map(n_layer, list(range(world_size)))[rank]
    stage = build_stage(model, layers, device, first=rank == 0, last=rank == world_size - 1, lane=f"stage {rank}")
    with Mesh(pp=world_size).build(timeout=timeout) as pm:  # the pipeline talks over its own group
        (results, events, kv, groups), seconds = _timed(lambda: run_pipeline_stage(
            stage, requests, rank, world_size, config.groups or world_size, config.max_batch, model.config.vocab_size,
            timeout, group=pm.group("pp")), ranked=True)
    return results, [RankReport(stage.lane, kv, _weight_bytes(stage), events, groups=groups)], seconds


def _cache_size(requests: Sequence[Request], config: ServeConfig) -> tuple[int, int]:
    """``(rows, slots)`` of an engine's cache: the groups it serves one at a time, the longest request.

    Sized to the work rather than to the model's context, so every strategy's census counts what
    it really needs (pipeline stages hold one cache per group in flight, :mod:`.pipeline`).
    """
    return max(1, min(config.max_batch, len(requests))), max((r.slots for r in requests), default=1)


def _reports(engine: Engine) -> list[RankReport]:
    """One report per stage of an in-process engine (per device for mp)."""
    counts = [(step, c.calls_of("all_reduce"), c.calls_of()) for step, c in engine.collectives]
    return [RankReport(stage.lane, cache.nbytes(), _weight_bytes(stage),
                       [e for e in engine.device_events if e.lane == stage.lane], counts, engine.groups)
            for stage, cache in zip(engine.stages, engine.caches)]
