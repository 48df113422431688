"""Pipeline benchmark: ``python -m parallel_lib.bench pp [--quick]``.

Two stages of the same MLP, one training step (forward, MSE loss, backward) timed
for m = 1, 2, 4, 8 micro-batches by:

- plain model parallelism: one thread runs stage 0, then stage 1 (the baseline);
- :class:`parallel_lib.pipeline_parallel.Pipe` with GPipe and with 1F1B (one thread per stage);
- ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` on the same
  stages, one gloo process per stage (NCCL and a GPU each where there are two).

Each speedup over the baseline is printed beside the ideal ``p·m/(m+p-1)``. The
machine's own ceiling is measured in the same run: the two stages' forward and
backward on the full batch, with no dependency between them, run by two threads
and by two processes, against running them one after the other. A pipeline cannot
beat that ceiling, so it answers with numbers whether threads or processes suit a
pipeline on this machine. Variants are interleaved repeat by repeat and the median
is kept, so a neighbour's load spreads over all of them alike.
"""

from __future__ import annotations



import torch

from parallel_lib.bench import REPEATS, parse_config
from parallel_lib.bench._pp_runs import BUSY_CEILING, P, QUICK, RUNNERS, Config, Results, make_stages, run
from parallel_lib.common.tables import markdown_table

__all__ = ["Config", "QUICK", "Results", "RUNNERS", "make_stages", "run", "ideal", "markdown", "main"]


def ideal(m: int, p: int = P) -> float:
    """Speedup of a perfect pipeline with p equal stages over running them in turn."""
    return p * m / (m + p - 1)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.{0 if seconds >= 0.01 else 1}f} ms"


def markdown(results: Results) -> str:
    """The results as Markdown: a table by runner and m, baselines, ceilings, target and verdict."""
    c, ms = results.config, results.config.micro_batches
    rows = [["ideal p·m/(m+p−1)"] + [f"{ideal(m):.2f}×" for m in ms]]
    for key, label in RUNNERS.items():
        if key in results.steps:
            row = results.steps[key]
            rows.append([label] + [f"{_ms(row[m])} · {results.speedup(key, m):.2f}×" if m in row else "n/a"
                                   for m in ms])
    lines = [f"### Pipeline parallelism, {P} stages — {results.machine}", "",
             f"Stages: {c.depth} × (Linear {c.width}→{c.width} + Tanh) each, batch {c.batch}, MSE loss, "
             f"devices {', '.join(results.devices)}; median of {c.repeats} interleaved repeats, "
             f"torch {torch.__version__}. Cells: step time · speedup over plain model parallelism.", "",
             markdown_table(["runner"] + [f"m={m}" for m in ms], rows)]
    baseline = f"{_ms(results.plain)} per step"
    ceilings = f"2 threads {results.thread_ceiling:.2f}×"
    if results.process_ceiling is not None:
        baseline += f" (timed again inside rank 0 during the process runs: {_ms(results.plain_processes or 0)})"
        ceilings += f", 2 processes {results.process_ceiling:.2f}×"
    lines += ["", f"Baseline, plain model parallelism (one thread, stage 0 then stage 1): {baseline}.",
              f"Ceiling, the same stage work with no dependencies vs one after the other: {ceilings}."]
    if results.thread_ceiling < BUSY_CEILING:
        lines.append(f"Warning: two threads with no dependencies ran only {results.thread_ceiling:.2f}× as fast as "
                     "one: other work shared the cores during this run, or the work is too small to hide "
                     "the cost of starting threads (--quick). The speedups above say little about "
                     "pipelining; rerun the full size on a quiet machine.")
    gpipe = results.steps["gpipe"]
    best_m = max(gpipe, key=lambda m: results.speedup("gpipe", m))
    best = results.speedup("gpipe", best_m)
    bound = 0.85 * min(ideal(best_m), results.thread_ceiling)
    lines.append(f"Target: Pipe GPipe at its best m={best_m} reaches {best:.2f}×; 0.85 × min(ideal "
                 f"{ideal(best_m):.2f}×, thread ceiling {results.thread_ceiling:.2f}×) = {bound:.2f}× — "
                 f"{'met' if best >= bound else 'NOT met'}.")
    if best_m in results.steps.get("torch-gpipe", {}):
        other = results.speedup("torch-gpipe", best_m)
        verdict = f"Threads vs processes at m={best_m}: Pipe GPipe {best:.2f}×, ScheduleGPipe {other:.2f}×. "
        if best >= other:
            verdict += ("Threads win here: a stage hands its neighbour a pointer, while processes send "
                        "every activation and gradient through gloo.")
        else:
            verdict += (f"Processes win here. The ceilings show why: independent stage work overlaps "
                        f"{results.process_ceiling:.2f}× in two processes but {results.thread_ceiling:.2f}× in "
                        "two threads of one process (one interpreter lock, one memory allocator), and no "
                        "pipeline beats its ceiling.")
        lines.append(verdict)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    config, _ = parse_config(argv, "pp", __doc__, QUICK, Config, "tiny sizes, 2 repeats: a smoke run",
                             [REPEATS, ("--no-processes", {"action": "store_false", "dest": "processes", "default": None,
                                                           "help": "skip torch.distributed.pipelining"})])
    print(markdown(run(config)))
    return 0
