"""The pipeline benchmark's measurements (``python -m parallel_lib.bench pp`` prints them).

Kept apart from the report in :mod:`parallel_lib.bench.pp`: this module is what runs
(threads, and gloo ranks that import it by name), that one only formats numbers.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.timeline import DeviceClock
from parallel_lib.pipeline_parallel.pipe import Pipe
from parallel_lib.runtime.device import devices as stage_devices
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch

__all__ = ["P", "BUSY_CEILING", "RUNNERS", "Config", "QUICK", "Results", "make_stages", "run"]

P = 2  # stages
BUSY_CEILING = 1.3  # below this thread ceiling, the run did not measure pipelining (busy cores, tiny work)
RUNNERS = {"gpipe": "Pipe, GPipe (threads)", "1f1b": "Pipe, 1F1B (threads)",
           "torch-gpipe": "torch.distributed.pipelining ScheduleGPipe (processes)",
           "torch-1f1b": "torch.distributed.pipelining Schedule1F1B (processes)"}


@dataclass(frozen=True)
class Config:
    """The work: each stage is ``depth`` x (Linear(width, width), Tanh); batches of ``batch`` rows.

    The default makes every micro-batch at m = 8 a matrix of 256 rows, large enough
    that its matrix products are compute-bound and the per-task overhead (queue
    hand-over, Python) is small against them.
    """

    width: int = 512
    depth: int = 4
    batch: int = 2048
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    repeats: int = 5
    processes: bool = True  # also run torch.distributed.pipelining and the process ceiling
    seed: int = 0


QUICK = Config(width=64, depth=2, batch=64, micro_batches=(1, 2, 4), repeats=2)


@dataclass
class Results:
    """Median seconds per step; ``steps[runner][m]``, ceilings as speedups.

    Process runners are compared with ``plain_processes``, the baseline timed inside
    rank 0 during their phase, so that load that comes and goes between the two
    phases does not pass for a speedup.
    """

    config: Config
    machine: str
    devices: list[str]
    plain: float
    steps: dict[str, dict[int, float]] = field(default_factory=dict)
    thread_ceiling: float = 0.0
    process_ceiling: Optional[float] = None
    plain_processes: Optional[float] = None  # the baseline again, timed in rank 0 amid the process runs

    def speedup(self, runner: str, m: int) -> float:
        """Baseline time over the runner's step time at m micro-batches."""
        process = runner.startswith("torch-") and self.plain_processes is not None
        return (self.plain_processes if process else self.plain) / self.steps[runner][m]  # type: ignore[operator]


def make_stages(config: Config) -> nn.Sequential:
    """The two stages, seeded: every process builds identical weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return nn.Sequential(*[nn.Sequential(*[layer for _ in range(config.depth)
                                               for layer in (nn.Linear(config.width, config.width), nn.Tanh())])
                               for _ in range(P)])


def _data(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(config.seed + 1)
    return (torch.randn(config.batch, config.width, generator=generator),
            torch.randn(config.batch, config.width, generator=generator))


def _plain_step(parts: nn.Module, devices: list[torch.device], x: torch.Tensor, y: torch.Tensor) -> None:
    """Plain model parallelism: the whole batch through stage 0, then stage 1, loss, backward."""
    h = x
    for part, device in zip(parts, devices):
        h = part(h.to(device))
    nn.functional.mse_loss(h, y.to(devices[-1])).backward()


def _stage_work(stage: nn.Module, x: torch.Tensor) -> None:
    """One stage's forward and backward on the full batch, as a pipeline would run it."""
    out = stage(x)
    torch.autograd.backward(out, torch.ones_like(out))


def _timed(fn: Callable[[], None], devices: list[torch.device]) -> float:
    """Seconds ``fn`` took, until ``devices`` (and only those) ran the work it queued."""
    clock = DeviceClock(devices)
    start = clock()
    fn()
    return clock() - start


def _in_threads(fns: list[Callable[[], None]]) -> None:
    """Run each function on its own thread (one intra-op thread each), wait for all, re-raise a failure."""
    barrier = threading.Barrier(len(fns))
    errors: list[BaseException] = []

    def body(fn: Callable[[], None]) -> None:
        torch.set_num_threads(1)
        try:
            barrier.wait(timeout=60)
            fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors.append(error)

    threads = [threading.Thread(target=body, args=(fn,), name=f"bench-ceiling-{k}") for k, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise RuntimeError("a ceiling thread failed") from errors[0]


def _measure_threads(config: Config) -> Results:
    """Baseline, Pipe variants and the thread ceiling, interleaved repeat by repeat, in this process."""
    model, (x, y) = make_stages(config), _data(config)
    devices = stage_devices(P)
    mse = nn.functional.mse_loss
    pipes = {(name, m): Pipe(model, devices, chunks=m, schedule=name)
             for name in ("gpipe", "1f1b") for m in config.micro_batches}
    parts = next(iter(pipes.values())).partitions
    xs = [x.to(d) for d in devices]

    def plain() -> None:
        _plain_step(parts, devices, x, y)

    def pipelined(pipe: Pipe) -> Callable[[], None]:
        return lambda: pipe.train_step(x, y, mse)  # type: ignore[return-value]

    def serial() -> None:
        for part, h in zip(parts, xs):
            _stage_work(part, h)

    def threads() -> None:
        _in_threads([lambda part=part, h=h: _stage_work(part, h) for part, h in zip(parts, xs)])

    variants: dict[object, Callable[[], None]] = {"plain": plain, "serial": serial, "threads": threads}
    variants.update({key: pipelined(pipe) for key, pipe in pipes.items()})
    times: dict[object, list[float]] = {key: [] for key in variants}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # the baseline gets one intra-op thread, as each pipeline stage does
    try:
        for repeat in range(config.repeats + 1):  # repeat 0 warms up caches and allocators
            for key, fn in variants.items():
                model.zero_grad(set_to_none=True)
                seconds = _timed(fn, devices)
                if repeat:
                    times[key].append(seconds)
    finally:
        torch.set_num_threads(threads_before)
        for pipe in pipes.values():
            pipe.close()
    median = {key: statistics.median(ts) for key, ts in times.items()}
    results = Results(config, machine_label(), [str(d) for d in devices], plain=median["plain"],
                      thread_ceiling=median["serial"] / median["threads"])
    for name, m in pipes:
        results.steps.setdefault(name, {})[m] = median[(name, m)]
    return results


def _process_worker(rank: int, world_size: int, config: Config) -> dict[str, object]:
    """One rank of the process measurements: ceiling (alone vs together) and torch pipelining."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    device = rank_device()
    model = make_stages(config).to(device)  # rank 0 also times the baseline, in this phase's conditions
    stage = model[rank]
    x, y = (t.to(device) for t in _data(config))
    schedules = {}
    for name, cls in (("torch-gpipe", ScheduleGPipe), ("torch-1f1b", Schedule1F1B)):
        for m in config.micro_batches:
            if cls is Schedule1F1B and m < world_size:
                continue  # torch's 1F1B needs at least one micro-batch per stage
            pipeline_stage = PipelineStage(stage, rank, world_size, device)
            schedules[(name, m)] = cls(pipeline_stage, n_microbatches=m, loss_fn=nn.functional.mse_loss)
    times: dict[object, list[float]] = {key: [] for key in [*schedules, "together", "plain"]}
    times.update({f"alone {r}": [] for r in range(world_size)})
    for repeat in range(config.repeats + 1):
        dist.barrier()
        if rank == 0:
            model.zero_grad(set_to_none=True)
            times["plain"].append(_timed(lambda: _plain_step(model, [device] * world_size, x, y), [device]))
        for turn in range(world_size):  # each rank alone while the others wait: the serial time
            dist.barrier()
            if turn == rank:
                seconds = _timed(lambda: _stage_work(stage, x), [device])
                times[f"alone {turn}"].append(seconds)
        dist.barrier()
        times["together"].append(_timed(lambda: _stage_work(stage, x), [device]))
        for key, schedule in schedules.items():
            stage.zero_grad(set_to_none=True)
            dist.barrier()
            run = (lambda s=schedule: s.step(x)) if rank == 0 else (lambda s=schedule: s.step(target=y, losses=[]))
            times[key].append(_timed(run, [device]))
    return {key: ts[1:] for key, ts in times.items() if ts}  # drop the warm-up repeat


def _measure_processes(config: Config, results: Results) -> None:
    per_rank = launch(_process_worker, P, config, backend="auto", threads_per_rank=1,
                      timeout=120 + 60 * config.repeats)
    def step(key: str) -> float:  # a step ends when its slowest rank is done
        return statistics.median(max(ts) for ts in zip(*(r[key] for r in per_rank)))
    serial = sum(statistics.median(per_rank[r][f"alone {r}"]) for r in range(P))
    results.process_ceiling = serial / step("together")
    results.plain_processes = statistics.median(per_rank[0]["plain"])
    for key in per_rank[0]:
        if isinstance(key, tuple):
            name, m = key
            results.steps.setdefault(name, {})[m] = step(key)


def run(config: Config = Config()) -> Results:
    """Measure every variant on this machine (see the module docstring)."""
    results = _measure_threads(config)
    if config.processes:
        _measure_processes(config, results)
    return results
