"""The planner checked against reality: every layout it prices, run for real on this machine's gloo ranks.

``python -m parallel_lib.bench planner [--quick]`` calibrates this machine
(:func:`parallel_lib.planner.calibrate.calibrate`), then runs tiny GPT-2 (vocabulary 512, 64 tokens,
16 sequences per step) under each layout with the chapters' own engines — ZeRO 0–3 from
``sharding/`` (chapter 06); pipelines with GPipe and 1F1B and DP×PP on the course's corpus (chapters
04, 05), tensor parallelism ± sequence parallelism (chapter 07's runs, ``training.tp_layout``) and
TP×PP with and without recomputation, all as plans of the one training entry (``training.train``);
one process with and without recomputation (chapter 08's measurement) — and puts measured step
time and model-state bytes beside :func:`parallel_lib.planner.layout.price`'s prediction.
Goals (issue #21): step time within 25 %, model state within 1 %. ``--quick`` runs two layouts on 2 ranks.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_lib.common import tables
from parallel_lib.common.models import build_gpt2, gpt2_config
from parallel_lib.planner.__main__ import describe
from parallel_lib.planner.calibrate import SIZES, Calibration, RankSpeed, calibrate, collective_worker
from parallel_lib.planner.layout import Layout, price
from parallel_lib.planner.model_step import PROBE_BATCH, entry_step, step_key, time_step
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.batches import TPConfig
from parallel_lib.training import Plan, RunConfig, tp_layout, train, zero_plan
from parallel_lib.training.traffic import dp_groups

__all__ = ["Row", "jobs", "run_jobs", "run_layouts", "measure", "markdown", "main"]

VOCAB, SEQ, BATCH = 512, 64, 16
TIME_GOAL, STATE_GOAL = 0.25, 0.01  # a row's step time and model state within these of the prediction
KEY = step_key("tiny", VOCAB, SEQ)


@dataclass(frozen=True)
class Row:
    """One layout: predicted beside measured (seconds per step, model-state bytes of the busiest rank)."""

    layout: Layout
    engine: str
    predicted_seconds: float
    measured_seconds: float
    predicted_state: float
    measured_state: float
    state_how: str                    # how the state was measured
    load: float = 1.0                 # the probe's step time around the run / the calibration's

    @property
    def time_error(self) -> float:
        return self.predicted_seconds / self.measured_seconds - 1

    @property
    def state_error(self) -> float:
        return self.predicted_state / self.measured_state - 1


def jobs(world_size: int, steps: int, quick: bool = False) -> list[tuple[Layout, str, Any, GPTShape]]:
    """``(layout, engine, config, model shape)`` for every layout run on ``world_size`` ranks."""
    sharded = RunConfig(model="tiny", vocab_size=VOCAB, batch_size=BATCH, seq_len=SEQ, steps=steps,
                        return_state=False)  # ZeRO over every rank, one micro-batch: chapter 06's runs
    tp_shape = GPTShape.of(gpt2_config("tiny", VOCAB))
    corpus = RunConfig(model="tiny", data="corpus", vocab_size=VOCAB, seq_len=SEQ, batch_size=BATCH, steps=steps,
                       train_examples=BATCH * steps, return_state=False)  # chapter 05's run

    def zero(k: int) -> tuple[Layout, str, Any, GPTShape]:
        return Layout(dp=world_size, zero=k), "training.train", (zero_plan(world_size, k), sharded), tp_shape

    def pipe(dp: int, schedule: str, m: int) -> tuple[Layout, str, Any, GPTShape]:
        pp = world_size // dp
        return (Layout(dp=dp, pp=pp, schedule=schedule, micro_batches=m), "training.train",
                (Plan(dp=dp, pp=pp, schedule=schedule, micro_batches=m), corpus), tp_shape)

    def tp(t: int, sp: bool) -> tuple[Layout, str, Any, GPTShape]:
        config = TPConfig(model="tiny", vocab_size=VOCAB, batch_size=BATCH // (world_size // t), seq_len=SEQ,
                          steps=steps, tp=t, sequence_parallel=sp, padding=False)
        dp = world_size // t  # the replicas average their gradients in ZeroEngine's flat buckets
        buckets = len(dp_groups(tp_shape, t, tp_shape.n_layer, True, True, 1, 0, dp))
        layout = Layout(dp=dp, tp=t, sequence_parallel=sp, grad_collectives=buckets)
        return layout, "training.train", tp_layout(config, world_size, return_state=False), tp_shape

    three_d = RunConfig(model="tiny", vocab_size=VOCAB, seq_len=SEQ, batch_size=BATCH, lr=1e-3, steps=steps,
                        return_state=False)

    def grid(rc: bool) -> tuple[Layout, str, Any, GPTShape]:
        layout = Layout(tp=2, pp=2, micro_batches=4, recompute=rc)
        return layout, "training.train", (Plan(tp=2, pp=2, micro_batches=4, recompute=rc), three_d), tp_shape

    if quick:
        return [zero(0), pipe(1, "1f1b", 4)]
    if world_size == 2:
        return [zero(0), zero(1), zero(2), zero(3), tp(2, False), tp(2, True), pipe(1, "gpipe", 4), pipe(1, "1f1b", 4)]
    return [zero(0), zero(2), tp(2, False), pipe(2, "1f1b", 2), grid(False), grid(True)]


def _probe(repeats: int) -> float:
    """Seconds of one step of the calibration's model on every rank at once, the slowest rank's median of
    ``repeats`` (as the calibration takes it): how busy the machine is now."""
    # every rank starts together: ranks that left the last run early would probe beside fewer busy ranks (idle
    # 2-core machine, 4 ranks: the probe read a median 0.89 of the calibration, 0.53-1.09, without this; 0.95 with)
    dist.barrier()
    seconds = torch.tensor(time_step("tiny", VOCAB, SEQ, PROBE_BATCH, repeats), device=rank_device())  # NCCL: GPU
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def run_jobs(rank: int, world_size: int, work: Sequence[tuple[str, Any]], alone: Calibration, repeats: int = 5,
             warm_up: bool = True) -> tuple[RankSpeed, list[tuple[list[float], float, float]]]:
    """This world size's calibration, then every ``(engine, config)`` in turn on this rank.

    Returns the calibration (:func:`~parallel_lib.planner.calibrate.collective_worker`, in the same
    launch: one start-up less) and, per run, ``(step seconds, model-state bytes, probe seconds)``.
    A shared 2-core machine is busier at some moments than at others; a probe around each run (the
    calibration's own model step, repeated) says how much, and the prediction is scaled by it.
    """
    speed = collective_worker(rank, world_size, SIZES, repeats, alone)
    out = []
    if work and warm_up:  # a first run pays for lazy set-up (allocator, gloo pairs, kernels): one short run, not timed
        _run(rank, world_size, work[0][0], _shortened(work[0][1]))
    for engine, config in work:
        before = _probe(repeats)
        times, state = _run(rank, world_size, engine, config)
        out.append((times, state, (before + _probe(repeats)) / 2))  # the machine's speed around the run
    return speed, out


def _shortened(config: Any) -> Any:
    """The same run for 2 steps (a warm-up); ``training.train``'s config is a ``(Plan, RunConfig)`` pair."""
    if isinstance(config, tuple):
        plan, run = config
        return plan, replace(run, steps=2)
    return replace(config, steps=2)


def _run(rank: int, world_size: int, engine: str, config: Any) -> tuple[list[float], float]:
    """One run with ``engine``: its step times on this rank and the model-state bytes it holds."""
    plan, run = config  # "training.train"
    g = train(rank, world_size, plan, run)
    return g.record.step_times, float(g.state_bytes)


def _step_time(per_rank: Sequence[Sequence[float]]) -> float:
    """A step lasts as long as its slowest rank; the median over steps after the first (warm-up)."""
    slowest = [max(times) for times in zip(*per_rank)]
    return statistics.median(slowest[1:] or slowest)


def _single(calibration: Calibration, steps: int, repeats: int = 5) -> list[Row]:
    """One process, plain and with recomputation: the training entry's forward + backward
    (:func:`~parallel_lib.planner.model_step.entry_step`), against the compute prediction."""
    rows = []
    model = build_gpt2("tiny", vocab_size=VOCAB, seed=0, n_positions=SEQ)
    shape = GPTShape.of(model.config)
    state = 16.0 * sum(q.numel() for q in model.parameters())
    for recompute in (False, True):
        load = time_step("tiny", VOCAB, SEQ, PROBE_BATCH, repeats) / calibration.at(1).step_times[KEY]
        with entry_step("tiny", VOCAB, SEQ) as (seconds, _):
            times = [seconds(BATCH, recompute) for _ in range(steps)]
        p = price(Layout(recompute=recompute), shape, BATCH, SEQ, calibration.slowed(1, load), KEY)
        rows.append(Row(p.layout, "model_step.entry_step (forward + backward only)", p.compute,
                        statistics.median(times[1:]), p.state_bytes, state, "parameters x 16 (AdamW fp32)", load))
    return rows


def run_layouts(work: Sequence[tuple[Layout, str, Any, GPTShape]], world_size: int, calibration: Calibration,
                repeats: int = 5, warm_up: bool = True, timeout: float = 600.0) -> list[Row]:
    """Run ``work`` (from :func:`jobs`) in one launch of ``world_size`` ranks; price each layout at its load.

    The launch calibrates ``world_size`` itself first, at the same moment as the runs, and that
    calibration replaces ``calibration``'s entry for ``world_size``.
    """
    alone = Calibration(calibration.machine, {1: calibration.at(1)})  # what the ranks scale their probe by
    launched = launch(run_jobs, world_size, [(engine, config) for _, engine, config, _ in work], alone, repeats,
                      warm_up, threads_per_rank=1, timeout=timeout)
    calibration.ranks[world_size] = launched[0][0]
    rows = []
    for k, (layout, engine, _, shape) in enumerate(work):
        per_rank = [out[k] for _, out in launched]
        load = per_rank[0][2] / calibration.at(world_size).step_times[KEY]  # > 1: busier than calibrated
        # the course's engines reduce after the backward and gather without prefetch: nothing overlaps
        p = price(layout, shape, BATCH, SEQ, calibration.slowed(world_size, load), KEY, overlap=False)
        how = "parameters x 4 (tensors) x 4" if engine.startswith("tensor") else "tensor census"
        rows.append(Row(layout, engine, p.step_seconds, _step_time([t for t, _, _ in per_rank]), p.state_bytes,
                        max(s for _, s, _ in per_rank), how, load))
    return rows


def measure(steps: int = 11, world_sizes: Sequence[int] = (2, 4), quick: bool = False, repeats: int = 5,
            timeout: float = 600.0) -> tuple[Calibration, list[Row]]:
    """Calibrate (one process here, each world size at the start of its launch), run every layout, price it."""
    calibration = calibrate(world_sizes=(), repeats=repeats)
    rows = [] if quick else _single(calibration, steps, repeats)
    for n in world_sizes:
        rows += run_layouts(jobs(n, steps, quick), n, calibration, repeats, not quick, timeout)
    return calibration, rows


def markdown(rows: Sequence[Row], machine: Optional[str] = None) -> str:
    cells = [[r.layout.name, r.layout.devices, r.engine, f"{r.load:.2f}", f"{r.predicted_seconds * 1e3:.1f}",
              f"{r.measured_seconds * 1e3:.1f}", f"{r.time_error:+.0%}",
              "yes" if abs(r.time_error) <= TIME_GOAL else "NO",
              f"{r.predicted_state / 1e6:.3f}", f"{r.measured_state / 1e6:.3f}", f"{r.state_error:+.1%}",
              "yes" if abs(r.state_error) <= STATE_GOAL else "NO", r.state_how] for r in rows]
    header = ["layout", "ranks", "engine", "load", "predicted ms", "measured ms", "error", f"<={TIME_GOAL:.0%}",
              "predicted state MB", "measured state MB", "error", f"<={STATE_GOAL:.0%}", "state measured by"]
    within = sum(abs(r.time_error) <= TIME_GOAL for r in rows)
    exact = sum(abs(r.state_error) <= STATE_GOAL for r in rows)
    return (f"Tiny GPT-2 (vocabulary {VOCAB}, {SEQ} tokens, {BATCH} sequences per step), measured on "
            f"{machine or machine_label()}.\n\n" + tables.markdown_table(header, cells) +
            f"\n\n{within} of {len(rows)} step times within {TIME_GOAL * 100:g} %; "
            f"{exact} of {len(rows)} model states within {STATE_GOAL * 100:g} %.")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.bench planner", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two layouts on 2 ranks, a short calibration")
    parser.add_argument("--steps", type=int, default=11)  # medians of 10 steps: 4 ranks on 2 cores vary step to step
    args = parser.parse_args(argv)
    if args.quick:
        calibration, rows = measure(steps=2, world_sizes=(2,), quick=True, repeats=2)
    else:
        calibration, rows = measure(steps=args.steps)
    print(describe(calibration))
    print()
    print(markdown(rows))
    return 0
