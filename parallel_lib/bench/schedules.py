"""Pipeline schedules benchmark (chapter 08): ``python -m parallel_lib.bench schedules [--quick]``.

For GPipe, 1F1B, interleaved 1F1B (v=2), ZB-H1, ZB-H2, ZB-V and DualPipeV, at m = 4, 8, 16:

- p = 2, threads: :class:`~parallel_lib.pipeline_parallel.Pipe` runs a training step of an MLP
  (8 blocks of Linear + Tanh, so interleaving has 4 stages to place). Printed: step time, the
  measured bubble beside the bubble simulated from the same run's measured F, B, W costs per
  stage, beside that simulation with the run's per-action dispatch overheads too
  (:func:`~parallel_lib.pipeline_parallel.timeline_stats.dispatch_overheads`), beside the closed
  form, and the peak saved-activation bytes per rank; below the table, what the split backward
  costs: ZB-H1's B + W per stage against 1F1B's whole backward in the same run;
- p = 4, simulated: the p = 2 costs per layer block, regrouped into 4 ranks, replayed;
- p = 2, processes: the same step on two gloo ranks (:mod:`parallel_lib.pipeline_parallel.process`),
  median over repeats of the slower rank's step time (p = 4 processes would put 4 ranks on this
  machine's cores; the benchmark does not run them);
- our order beside ``torch.distributed.pipelining``'s for the same p, m (``equal`` or the first difference).

Bubble convention: idle inside a rank's span / its work, max over ranks
(:mod:`parallel_lib.pipeline_parallel.simulator`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from parallel_lib.bench import REPEATS, parse_config
from parallel_lib.common.tables import markdown_table
from parallel_lib.pipeline_parallel import Pipe, make_schedule
from parallel_lib.pipeline_parallel.process import ProcessConfig, run_pipeline_ranks
from parallel_lib.pipeline_parallel.simulator import bubbles, measured_costs, simulate_schedule
from parallel_lib.pipeline_parallel.timeline_stats import dispatch_overheads
from parallel_lib.pipeline_parallel.torch_pp import compare_with_torch
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch

__all__ = ["Config", "QUICK", "NAMES", "formula", "run", "main"]

NAMES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"]


@dataclass(frozen=True)
class Config:
    width: int = 384
    blocks: int = 8
    batch: int = 512
    micro_batches: tuple[int, ...] = (4, 8, 16)
    repeats: int = 3
    names: tuple[str, ...] = tuple(NAMES)


QUICK = Config(width=32, batch=32, micro_batches=(4,), repeats=1)


def formula(name: str, p: int, m: int) -> Optional[float]:
    """The closed-form bubble with equal costs (None where there is no simple one)."""
    return {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved": (p - 1) / (2 * m),
            "zb-h1": (p - 1) / (3 * m) if m >= p else None,
            "zb-h2": 0.0 if m >= 2 * p - 1 else None, "zbv": 0.0 if m >= 2 * p - 1 else None,
            "dualpipev": (p - 1) / (6 * m) if m >= 2 * p else None}.get(name)


def _model(config: Config) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh())
                           for _ in range(config.blocks)])


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.0%}"


def process_times(config: Config) -> dict[tuple[str, int], float]:
    """Median step seconds over gloo processes, p = 2, for every (schedule, m)."""
    runs = [ProcessConfig(schedule=name, micro_batches=m, width=config.width, blocks=config.blocks, rows=config.batch,
                          timeout=120.0)
            for m in config.micro_batches for name in config.names] * (config.repeats + 1)
    results = launch(run_pipeline_ranks, 2, runs, backend="gloo", timeout=1800.0)
    times: dict[tuple[str, int], list[float]] = {}
    for k, run_config in enumerate(runs):
        if k >= len(runs) // (config.repeats + 1):  # the first round warms up
            times.setdefault((run_config.schedule, run_config.micro_batches), []).append(
                max(results[r][k]["seconds"] for r in range(2)))
    return {key: statistics.median(values) for key, values in times.items()}


def run(config: Config) -> tuple[list[list[object]], list[list[object]], str]:
    """Measured p=2 rows, simulated p=4 rows, and the split backward's cost against the whole one."""
    x, y = torch.randn(config.batch, config.width), torch.randn(config.batch, config.width)
    measured, simulated = [], []
    backward: dict[tuple[str, int], float] = {}  # (schedule, m) -> backward seconds summed over stages
    processes = process_times(config)
    for m in config.micro_batches:
        for name in config.names:
            times, runs = [], []
            with Pipe(_model(config), ["cpu", "cpu"], chunks=m, schedule=name) as pipe:
                pipe.train_step(x, y, nn.functional.mse_loss)  # warm-up
                for _ in range(config.repeats):
                    pipe.train_step(x, y, nn.functional.mse_loss)
                    events = list(pipe.timeline.events)
                    step, _, bubble, _ = bubbles(events, 2)
                    times.append(step)
                    runs.append((step, bubble, events))
                schedule = pipe.make_schedule(m)
                peak = pipe.peak_activation_bytes
            step, bubble, events = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            costs = measured_costs(events, schedule)
            if not schedule.split_backward:
                costs = [(f, b + w) for f, b, w in costs]  # type: ignore[misc]
            sim = simulate_schedule(schedule, costs)
            gap, hop = dispatch_overheads(events, schedule)
            padded = [tuple(c + gap for c in cost) for cost in costs]
            with_overheads = simulate_schedule(schedule, padded, max(0.0, hop - gap))
            backward[(name, m)] = sum(sum(cost[1:]) for cost in costs)
            measured.append([name, m, f"{statistics.median(times) * 1e3:.1f}",
                             f"{processes[(name, m)] * 1e3:.1f}", _pct(bubble), _pct(sim.bubble),
                             f"{_pct(with_overheads.bubble)} ({gap * 1e3:.2f} / {hop * 1e3:.2f})",
                             _pct(formula(name, 2, m)), " / ".join(f"{b / 2**20:.1f}" for b in peak),
                             compare_with_torch(make_schedule(name, 2, m))[:60] if name != "zb-h2" else "–"])
            simulated.append(_p4_row(name, m, costs, config.blocks))
    split = [f"m={m}: {backward[('zb-h1', m)] / backward[('1f1b', m)] - 1:+.0%}" for m in config.micro_batches
             if ("zb-h1", m) in backward and ("1f1b", m) in backward]
    note = ("Split backward (ZB-H1's B + W, summed over stages) against 1F1B's whole backward, same run: "
            + (", ".join(split) if split else "–"))
    return measured, simulated, note


def _p4_row(name: str, m: int, costs: list, blocks: int) -> list[object]:
    """p = 4 from the p = 2 costs: the mean cost of one layer block, times the blocks of each p=4 stage."""
    if name == "interleaved" and m % 4 or name == "dualpipev" and m < 8:
        return [name, m, "–", "m not a multiple of 4" if name == "interleaved" else "m < 2p", _pct(formula(name, 4, m)), "–"]
    schedule = make_schedule(name, 4, m)
    per_block = [sum(c[k] for c in costs) / blocks for k in range(len(costs[0]))]
    per_stage = tuple(x * blocks / schedule.num_model_stages for x in per_block)
    sim = simulate_schedule(schedule, [per_stage] * schedule.num_model_stages)
    return [name, m, f"{sim.step_time * 1e3:.1f}", _pct(sim.bubble), _pct(formula(name, 4, m)),
            compare_with_torch(schedule)[:60] if name != "zb-h2" else "–"]


def markdown(measured: list[list[object]], simulated: list[list[object]], note: str = "") -> str:
    header = ["schedule", "m", "step ms threads", "step ms processes", "bubble measured (threads)", "simulated",
              "sim. + dispatch (gap / hop ms)", "formula",
              "peak activations MiB / rank", "order vs torch"]
    p4 = ["schedule", "m", "step ms (sim.)", "bubble (sim.)", "formula", "order vs torch"]
    return "\n".join([f"Pipeline schedules on {machine_label()}", "", "p = 2, threads (Pipe):", "",
                      markdown_table(header, measured), "", note, "", "p = 4, simulated from the measured costs:", "",
                      markdown_table(p4, simulated)])


def main(argv: list[str]) -> int:
    config, _ = parse_config(argv, "schedules", __doc__, QUICK, Config, "tiny sizes, m = 4, one repeat: a smoke run",
                             [REPEATS])
    print(markdown(*run(config)))
    return 0
