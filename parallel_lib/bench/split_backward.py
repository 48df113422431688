"""What a split backward costs (chapter 08): ``python -m parallel_lib.bench split_backward [--quick]``.

Zero-bubble schedules split each backward into B (input gradients) and W (weight gradients);
they pay only if B + W costs what one whole backward costs. For one pipeline stage at widths
384, 768 and 1024, two models (the schedules benchmark's MLP stage: 4 blocks of Linear + Tanh, 128 rows;
two GPT-2 blocks, 2 sequences of 64 tokens), repeats interleaved, medians:

- F (unsplit, and recording the operations W is cut at), the whole backward, B, W, and the ratio
  (B + W) / whole, in one run: of the medians, the median of each repeat's own ratio (its split
  and unsplit passes ran within milliseconds of each other, so a shared machine's changing load
  moves both), and of each cost's fastest repeat (the least disturbed); one torch thread;
- 1F1B beside ZB-H1 simulated from those costs (1F1B: F and the whole backward; ZB-H1: the
  recording F, B and W; medians, and the fastest repeats) at p = 2 and 4, m = 8;
- 1F1B beside ZB-H1 at p = 2 and 4, m = 8, on an MLP of 8 blocks cut into p stages, one torch
  thread per stage, the two schedules' steps alternating: measured on gloo processes
  (:mod:`~parallel_lib.pipeline_parallel.process`, the slowest rank's step), measured on the
  threaded :class:`~parallel_lib.pipeline_parallel.Pipe` (one process: each action's Python
  shares the interpreter), and simulated from that stage's own measured costs twice: with a core
  per stage, and with the stages sharing this machine's cores (``simulate_schedule(cores=)``:
  busy ranks split the cores evenly, as the operating system time-slices processes). Where
  p stages share fewer cores a stage's idle time is another stage's compute: the step is near
  the total work over the cores, and ZB-H1 saves only what its order leaves idle even then.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from parallel_lib.bench import REPEATS, parse_config
from parallel_lib.common.models import gpt2_config
from parallel_lib.common.tables import markdown_table
from parallel_lib.models.attention import allowed_keys
from parallel_lib.models.dropout import DropoutStream
from parallel_lib.models.gpt2 import Block
from parallel_lib.pipeline_parallel import Pipe, make_schedule
from parallel_lib.pipeline_parallel.process import ProcessConfig, run_pipeline_ranks
from parallel_lib.pipeline_parallel.simulator import simulate_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch

__all__ = ["Config", "QUICK", "stage_costs", "run", "main"]


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (384, 768, 1024)
    rows: int = 128
    repeats: int = 40
    micro_batches: int = 8
    pipe_repeats: int = 9
    pipe_stages: tuple[int, ...] = (2, 4)

    @property
    def pipe_rows(self) -> int:
        """Rows per micro-batch of the pipelines (half a cost stage's, to keep their steps short)."""
        return self.rows // 2 if self.rows > 16 else self.rows


QUICK = Config(widths=(32,), rows=16, repeats=2, micro_batches=4, pipe_repeats=1)


def widths(text: str) -> tuple[int, ...]:
    """The argparse type of ``--widths``: comma-separated ints of at least 1 ("384,768")."""
    try:
        got = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers such as 384,768, got {text!r}") from None
    if min(got) < 1:
        raise argparse.ArgumentTypeError(f"every width must be >= 1, got {text!r}")
    return got


def _mlp(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])


class _Blocks(nn.Module):
    """Two GPT-2 blocks, (b, s, h) -> (b, s, h), causal."""

    def __init__(self, width: int) -> None:
        super().__init__()
        config = gpt2_config("tiny", vocab_size=64, n_embd=width, n_head=max(1, width // 64), n_layer=2,
                             n_positions=64, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(config, k, DropoutStream(0)) for k in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        allowed = allowed_keys(x.shape[1], device=x.device)
        for block in self.blocks:
            x = block(x, allowed)
        return x


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def stage_costs(module: nn.Module, x: torch.Tensor, count: int) -> dict[str, list[float]]:
    """Seconds of F, F recording, the whole backward, B and W of one stage, each repeat.

    The unsplit and the split pass alternate which runs first (the second one of a repeat finds
    the allocator in another state), and both start without gradients.

    Args:
        module: the stage (not the first: its input gets a gradient).
        x: one micro-batch's input.
        count: timed repeats (one more warms up).

    Returns:
        ``{"F", "F split", "whole", "B", "W"}``: the seconds of each timed repeat.
    """
    runner = StageRunner(module, torch.device("cpu"), first=False)
    grad = torch.randn_like(x)
    times: dict[str, list[float]] = {k: [] for k in ("F", "F split", "whole", "B", "W")}
    for k in range(count + 1):
        got: dict[str, float] = {}
        for split in ((False, True) if k % 2 else (True, False)):  # each goes first in every other repeat
            if split:
                got["F split"], (saved, _) = _timed(lambda: runner.forward(x, split=True))
                got["B"], (_, todo) = _timed(lambda: runner.backward_input(saved, grad))
                got["W"], _ = _timed(lambda: runner.backward_weight(todo))
            else:
                got["F"], (saved, _) = _timed(lambda: runner.forward(x))
                got["whole"], _ = _timed(lambda: runner.backward(saved, grad))
            module.zero_grad(set_to_none=True)  # both backwards start without gradients (no accumulation to time)
            del saved
        if k:  # the first round warms up
            for key in times:
                times[key].append(got[key])
    return times


def _simulated(costs: dict[str, float], p: int, m: int, cores: int | None = None) -> tuple[float, float]:
    """(1F1B's, ZB-H1's) simulated step seconds, p equal stages of these costs (on ``cores`` shared cores)."""
    one_f_one_b = simulate_schedule(make_schedule("1f1b", p, m), [(costs["F"], costs["whole"])] * p, cores=cores)
    zb = simulate_schedule(make_schedule("zb-h1", p, m), [(costs["F split"], costs["B"], costs["W"])] * p, cores=cores)
    return one_f_one_b.step_time, zb.step_time


def _process_steps(p: int, widths: tuple[int, ...], rows: int, m: int, count: int) -> dict[int, dict[str, list[float]]]:
    """Per width, seconds of each timed training step of the 8-block MLP on p gloo processes (the
    slowest rank's), 1F1B's and ZB-H1's steps alternating (one each warms up); one launch."""
    runs = [ProcessConfig(schedule=name, micro_batches=m, width=width, blocks=8, rows=rows * m, timeout=120.0)
            for width in widths for k in range(count + 1) for name in (("1f1b", "zb-h1") if k % 2 else ("zb-h1", "1f1b"))]
    results = launch(run_pipeline_ranks, p, runs, backend="gloo", timeout=600.0, threads_per_rank=1)
    times: dict[int, dict[str, list[float]]] = {width: {"1f1b": [], "zb-h1": []} for width in widths}
    for k, run_config in enumerate(runs):
        if k % (2 * (count + 1)) >= 2:  # each width's first round warms up
            times[run_config.width][run_config.schedule].append(max(results[r][k]["seconds"] for r in range(p)))
    return times


def _step_row(width: int, p: int, how: str, one_f_one_b: list[float], zb: list[float]) -> list[object]:
    """A table row from the steps of each schedule, paired in order."""
    ours, theirs = statistics.median(one_f_one_b), statistics.median(zb)
    paired = statistics.median(z / o for o, z in zip(one_f_one_b, zb))
    return ["MLP, 8 x (Linear + Tanh)", width, p, how, f"{ours * 1e3:.1f}", f"{theirs * 1e3:.1f}",
            f"{theirs / ours:.2f}", f"{paired:.2f}", f"{min(zb) / min(one_f_one_b):.2f}"]


def _pipe_steps(p: int, width: int, rows: int, m: int, count: int) -> dict[str, list[float]]:
    """Seconds of each timed training step of the 8-block MLP on threaded Pipes of p stages, 1F1B's and
    ZB-H1's steps alternating (one each warms up)."""
    x, y = torch.randn(rows * m, width), torch.randn(rows * m, width)
    times: dict[str, list[float]] = {"1f1b": [], "zb-h1": []}
    with contextlib.ExitStack() as stack:
        pipes = {name: stack.enter_context(Pipe(_mlp(width, 8), ["cpu"] * p, chunks=m, schedule=name))
                 for name in times}
        for k in range(count + 1):
            for name in (("1f1b", "zb-h1") if k % 2 else ("zb-h1", "1f1b")):
                seconds, _ = _timed(lambda: pipes[name].train_step(x, y, nn.functional.mse_loss))
                if k:  # the first round warms up
                    times[name].append(seconds)
    return times


def run(config: Config) -> tuple[list[list[object]], list[list[object]]]:
    """(the cost rows, the 1F1B-beside-ZB-H1 rows)."""
    costs_rows, step_rows = [], []
    rows = config.pipe_rows
    cores = os.cpu_count() or 1
    processes = {p: _process_steps(p, config.widths, rows, config.micro_batches, config.pipe_repeats)
                 for p in config.pipe_stages}  # one launch per p for every width: start-up is the slow part
    for width in config.widths:
        models = {"MLP, 4 x (Linear + Tanh)": (_mlp(width, 4), torch.randn(config.rows, width)),
                  "GPT-2, 2 blocks": (_Blocks(width), torch.randn(2, config.rows // 2, width))}
        for label, (module, x) in models.items():
            times = stage_costs(module, x, config.repeats)
            c = {key: statistics.median(values) for key, values in times.items()}
            least = {key: min(values) for key, values in times.items()}
            each = [{key: values[k] for key, values in times.items()} for k in range(config.repeats)]
            paired = statistics.median((t["B"] + t["W"]) / t["whole"] for t in each)
            costs_rows.append([label, width, *(f"{c[k] * 1e3:.2f}" for k in ("F", "F split", "whole", "B", "W")),
                               f"{(c['B'] + c['W']) / c['whole']:.2f}", f"{paired:.2f}",
                               f"{(least['B'] + least['W']) / least['whole']:.2f}"])
            for p in (2, 4):
                ours, zb = _simulated(c, p, config.micro_batches)
                ours_least, zb_least = _simulated(least, p, config.micro_batches)
                paired = statistics.median(zb_k / ours_k for ours_k, zb_k in
                                           (_simulated(t, p, config.micro_batches) for t in each))
                step_rows.append([label, width, p, "simulated", f"{ours * 1e3:.1f}", f"{zb * 1e3:.1f}",
                                  f"{zb / ours:.2f}", f"{paired:.2f}", f"{zb_least / ours_least:.2f}"])
        for p in config.pipe_stages:
            share = f"{min(cores, p) / p:.2g} core per stage"
            times = stage_costs(_mlp(width, 8 // p), torch.randn(rows, width), config.repeats)
            each = [{key: values[k] for key, values in times.items()} for k in range(config.repeats)]
            for how, shared in (("simulated, a core per stage", None),) + (
                    ((f"simulated, {cores} cores shared", cores),) if cores < p else ()):
                sims = [_simulated(t, p, config.micro_batches, shared) for t in each]
                step_rows.append(_step_row(width, p, how, [o for o, _ in sims], [z for _, z in sims]))
            steps = processes[p][width]
            step_rows.append(_step_row(width, p, f"measured (gloo processes, {share})", steps["1f1b"], steps["zb-h1"]))
            steps = _pipe_steps(p, width, rows, config.micro_batches, config.pipe_repeats)
            step_rows.append(_step_row(width, p, f"measured (Pipe threads, {share})", steps["1f1b"], steps["zb-h1"]))
    return costs_rows, step_rows


def markdown(costs_rows: list[list[object]], step_rows: list[list[object]], config: Config) -> str:
    cores = os.cpu_count() or 1
    head = ["stage", "width", "F ms", "F recording ms", "whole backward ms", "B ms", "W ms", "(B + W) / whole",
            "median of each repeat's", "of the fastest repeats"]
    steps = ["model", "width", "p", "how", "1F1B step ms", "ZB-H1 step ms", "ZB-H1 / 1F1B",
             "median of each repeat's", "of the fastest repeats"]
    return "\n".join([f"Split backward on {machine_label()} ({torch.get_num_threads()} torch threads, {cores} cores; "
                      f"medians of {config.repeats} interleaved repeats)", "", markdown_table(head, costs_rows), "",
                      f"1F1B beside ZB-H1, m = {config.micro_batches} (the pipelines: {config.pipe_repeats} steps "
                      f"each, alternating, {config.pipe_rows} rows per "
                      f"micro-batch, {cores} cores; simulated from each repeat of the pipeline stage's own costs; "
                      "where a stage has less than one core the step nears the total work over the cores):",
                      "", markdown_table(steps, step_rows)])


def main(argv: list[str]) -> int:
    config, _ = parse_config(argv, "split_backward", __doc__, QUICK, Config, "width 32, two repeats: a smoke run",
                             [REPEATS, ("--widths", {"type": widths, "help": "stage widths, e.g. 384,768"})])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared machine a thread pool's waits would dominate these small products
    try:
        print(markdown(*run(config), config))
    finally:
        torch.set_num_threads(threads)
    return 0
