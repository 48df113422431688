"""Regenerate every image under ``figures/``: ``python -m parallel_lib.figures``.

Each figure is one entry of :data:`FIGURES`: a file stem, the chapter it belongs to,
whether it is measured on this machine, and the function that makes it. The viz
modules only draw; the measuring (launching ranks, timing a model) happens here, in
the library functions each entry calls, so a figure shows exactly what the library
computes and ``viz`` never starts a process. A chapter adds a figure by adding an entry.

    python -m parallel_lib.figures                      # all of them (measured ones take minutes)
    python -m parallel_lib.figures --only ch02 ch04     # one or more chapters, or stems
    python -m parallel_lib.figures --static             # only the computed/simulated ones (seconds)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede pyplot's import by the viz modules
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["FigureSpec", "FIGURES", "collect", "main"]

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "figures"


@dataclass(frozen=True)
class FigureSpec:
    """One image under ``figures/``."""

    stem: str                       # file name without ".png"
    chapter: str                    # "ch00" .. "ch13"
    measured: bool                  # True: timed on this machine (labelled with it); False: computed, identical every run
    make: Callable[[], Figure]


# ----------------------------------------------------------------------------- chapter 00

def _setup_all_reduce() -> Figure:
    from parallel_lib.runtime import all_reduce_demo, launch
    from parallel_lib.viz.setup import plot_all_reduce
    return plot_all_reduce(launch(all_reduce_demo, 2))


def _setup_tiny_loss() -> Figure:
    from parallel_lib.quickstart import tiny_run
    from parallel_lib.runtime import machine_label
    from parallel_lib.viz.setup import plot_loss
    return plot_loss(tiny_run(), machine_label())


# ----------------------------------------------------------------------------- chapters 01-02

def _dp_partitions() -> Figure:
    from parallel_lib.viz.dp import render_partitions
    return render_partitions()


def _dp_throughput() -> Figure:
    from parallel_lib.data import global_batch_indices
    from parallel_lib.runtime import machine_label
    from parallel_lib.training import Plan, RunConfig, train_layout
    from parallel_lib.viz.dp import render_throughput

    epoch = {1: len(global_batch_indices(1024, 1, 32)), 2: len(global_batch_indices(1024, 2, 64))}  # steps
    run = RunConfig(data="corpus", model="tiny", batch_size=64, seq_len=64, vocab_size=2048, train_examples=1024,
                    steps=3 * epoch[2], return_state=False)  # 3 epochs
    one = replace(run, batch_size=32, steps=3 * epoch[1])
    runs = {"1 rank": (train_layout(Plan(sync="none", micro_batches=1), one, timeout=600), epoch[1]),
            "2 ranks": (train_layout(Plan(dp=2, sync="bucketed", micro_batches=1), run, timeout=600), epoch[2])}
    return render_throughput(runs, title=f"tiny GPT-2, 32 rows per rank and step, one core per rank; "
                                         f"{machine_label()}")


def _ring_steps() -> Figure:
    from parallel_lib.viz.ring import render_ring_strip
    return render_ring_strip(4)


def _allreduce_bandwidth() -> Figure:
    from parallel_lib.bench.allreduce import Config, measure
    from parallel_lib.viz.ring import render_bandwidth
    return render_bandwidth(measure(Config(sizes=tuple(4**k * 2**10 for k in range(8)), repeats=5)))  # 1 KB..16 MB


# ----------------------------------------------------------------------------- chapter 03

def _device_map_12_on_5() -> Figure:
    from parallel_lib.model_parallel import get_device_map, naive_device_map
    from parallel_lib.viz.device_map import plot_device_maps
    return plot_device_maps({"classic: blocks of ceil(12 / 5) = 3": naive_device_map(12, range(5)),
                             "balanced: get_device_map": get_device_map(12, range(5))},
                            title="12 GPT-2 layers on 5 devices")


def _model_parallel_timeline() -> Figure:
    from parallel_lib.model_parallel import measure_step_timeline
    from parallel_lib.runtime import machine_label
    from parallel_lib.viz.timeline import plot_timeline
    events = measure_step_timeline()
    return plot_timeline(events, title=f"tiny GPT-2, one step split over 4 devices ({machine_label()})")


def _memory_llama2_7b_v100() -> Figure:
    from parallel_lib.model_parallel import GiB, model_memory
    from parallel_lib.viz.memory import plot_memory
    return plot_memory(model_memory("llama-2-7b", "fp16", "adamw"), 16 * GiB, n_devices=4,
                       title="LLaMA-2-7B, fp16 mixed precision, AdamW")


# ----------------------------------------------------------------------------- chapter 04

def _pipeline_schedules(fractions: Sequence[float] = ()) -> Figure:
    from parallel_lib.pipeline_parallel import make_schedule
    from parallel_lib.viz.schedule import render_schedules
    return render_schedules([make_schedule(name, 4, 8) for name in ("gpipe", "1f1b")], (1.0, 2.0), fractions)


# ----------------------------------------------------------------------------- chapter 08

def _schedule_zoo() -> Figure:
    from parallel_lib.pipeline_parallel import make_schedule
    from parallel_lib.viz.schedule import render_schedules
    names = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")
    return render_schedules([make_schedule(name, 4, 8) for name in names], (1.0, 2.0), title="F = B = W = 1")


# ----------------------------------------------------------------------------- chapter 05

def _strategy_options() -> Figure:
    from parallel_lib.planner import plan
    from parallel_lib.viz.strategy import plot_plan
    return plot_plan(plan("llama-2-7b", 4096, 64, 80, 8))


def _strategy_decision_map() -> Figure:
    from parallel_lib.viz.strategy import DECISION_MODELS, plot_decision_map
    return plot_decision_map(DECISION_MODELS, [1, 2, 4, 8, 16, 32, 64], 80, 2048, 64)


# ----------------------------------------------------------------------------- chapter 06

def _zero_census() -> Figure:
    from parallel_lib.runtime import machine_label
    from parallel_lib.training.zero_measure import measure_stages
    from parallel_lib.viz.sharding import plot_zero_memory
    return plot_zero_memory(*measure_stages(2), title=f"tiny GPT-2, 2 ranks, bf16 + fp32 master ({machine_label()})",
                            unit=1e3, unit_name="kB")


def _zero_calculator() -> Figure:
    from parallel_lib.viz.sharding import calculator_figure
    return calculator_figure(7.5, 64, 3, "bf16", "AdamW")


def _zero3_timeline() -> Figure:
    from parallel_lib.training.zero_measure import zero3_timelines
    from parallel_lib.viz.sharding import plot_zero_timelines
    return plot_zero_timelines(zero3_timelines(2))


# ----------------------------------------------------------------------------- chapter 07

def _tp_layer_steps() -> Figure:
    from parallel_lib.runtime import launch
    from parallel_lib.tensor_parallel.verify import layer_trace
    from parallel_lib.viz.tensor_parallel import render_frames
    return render_frames(launch(layer_trace, 2, True, backend="gloo")[0], tp=2)


def _tp_step_times() -> Figure:
    from parallel_lib.bench.tp import SWEEP, measure, sweep_series
    from parallel_lib.runtime import machine_label
    from parallel_lib.viz.tensor_parallel import render_step_times
    return render_step_times(*sweep_series(measure(SWEEP)), title=f"2-layer GPT-2, tp = 1 vs 2 ({machine_label()})")


# ----------------------------------------------------------------------------- chapter 09

def _inference_calculator() -> Figure:
    from parallel_lib.viz.inference import calculator_figure
    return calculator_figure("llama-2-7b", "A100 80GB (published)", "tp", 2, 8, 2048, 256)


def _inference_roofline() -> Figure:
    from parallel_lib.inference.cost_model import GPUS, forward_bytes, forward_flops, step_seconds
    from parallel_lib.viz.inference import plot_roofline
    hw, points = GPUS["A100 80GB (published)"], {}
    for label, tokens, batch in (("prefill, 512-token prompt", 512, 0), ("decode, batch 1", 1, 1),
                                 ("decode, batch 64", 64, 64)):
        flops = forward_flops("llama-2-7b", tokens, 256 if not batch else 512)
        nbytes = forward_bytes("llama-2-7b", batch, 512, "fp16")
        points[label] = (flops / nbytes, flops / step_seconds(hw, flops, nbytes, 0))
    return plot_roofline(hw.flops_per_second, hw.bytes_per_second, points,
                         "LLaMA-2-7B fp16 on an A100 (published peak figures, not measured)")


def _inference_timelines() -> Figure:
    from parallel_lib.bench._inference_runs import Job, launch_jobs, make_requests
    from parallel_lib.inference import ServeConfig
    from parallel_lib.runtime import machine_label
    from parallel_lib.viz.inference import plot_request_timelines
    config = ServeConfig(max_batch=2, initializer_range=0.2)
    requests = make_requests(4, 8, 6, config.vocab_size, jitter=3)
    runs, _, _ = launch_jobs([Job(s, 2, requests, config) for s in ("mp", "dp", "pp", "tp")])
    return plot_request_timelines({f"{run.strategy}, 2 devices, 4 requests, groups of 2 ({machine_label()})": run
                                   for run in runs})


def _v_schedules() -> Figure:
    """Chapter 08's V shapes, ZB-V beside DualPipeV (the animation's two V schedules), p = 4, m = 8."""
    from parallel_lib.pipeline_parallel import make_schedule
    from parallel_lib.viz.schedule import render_schedules
    return render_schedules([make_schedule(name, 4, 8) for name in ("zbv", "dualpipev")], (1.0, 1.0, 1.0),
                            title="F = B = W = 1")


# ----------------------------------------------------------------------------- chapter 10
def _grid3d() -> Figure:
    from parallel_lib.runtime.mesh import Mesh
    from parallel_lib.viz.grid3d import render_grid3d
    return render_grid3d(Mesh(dp=2, tp=2, pp=2))


def _planner_widget() -> Figure:
    """Chapter 10's planning widget at its opening values (published H100 peaks, not measured)."""
    from parallel_lib.viz.planner import planner_figure
    return planner_figure()


# ----------------------------------------------------------------------------- chapter 11
def _ring_attention() -> Figure:
    """Chapter 11's ring attention replayed from the step record of a causal run on 4 gloo ranks, both splits.

    The record holds block indices and tile counts, not times: the image is the same on every machine.
    """
    from parallel_lib.context_parallel.verify import Case, attention_check
    from parallel_lib.runtime import launch
    from parallel_lib.viz.ring_attention import gathered_record, render_ring_attention_strip
    cases = [Case("ring", True, layout, heads=2, seq_len=32, block=4) for layout in ("contiguous", "zigzag")]
    ranks = launch(attention_check, 4, cases, backend="gloo", timeout=180)
    return render_ring_attention_strip(
        {f"cp 4, causal, {case.layout}": gathered_record(ranks, i) for i, case in enumerate(cases)},
        "Ring attention's forward steps as 4 gloo ranks recorded them (32 tokens, tiles of 4)")


# ----------------------------------------------------------------------------- chapter 12

def _moe_all_to_all() -> Figure:
    """Chapter 12's dispatch widget on paper: one forward of 2 gloo ranks, replayed from its routing records."""
    from parallel_lib.expert_parallel.walkthrough import DISPATCH_FIELDS, one_dispatch
    from parallel_lib.runtime import launch
    from parallel_lib.viz.expert_parallel import render_dispatch_grid
    records = launch(one_dispatch, 2, backend="gloo")
    return render_dispatch_grid(records, DISPATCH_FIELDS["n_experts"],
                                title=f"Expert parallelism on 2 ranks, {DISPATCH_FIELDS}: one forward's rows")


# ----------------------------------------------------------------------------- chapter 13

def _serving_steps() -> Figure:
    """Chapter 13's widget on paper: the walkthrough's requests through a pool of 6 blocks, from the engine's records.

    The records hold block tables and states, not times: the image is the same on every machine.
    """
    from parallel_lib.serving.walkthrough import walkthrough_model, walkthrough_run
    from parallel_lib.viz.serving_steps import render_serving_strip
    engine = walkthrough_run(walkthrough_model())
    return render_serving_strip(engine.records, engine.blocks.num_blocks, steps=(0, 1, 3, 5, 6, 7),
                                title="Six requests through a pool of 6 blocks of 4 slots, at most 4 per step "
                                      "(the engine's own step records)")


FIGURES: list[FigureSpec] = [
    FigureSpec("setup_all_reduce", "ch00", True, _setup_all_reduce),
    FigureSpec("setup_tiny_loss", "ch00", True, _setup_tiny_loss),
    FigureSpec("dp_partitions", "ch01", False, _dp_partitions),
    FigureSpec("dp_throughput", "ch01", True, _dp_throughput),
    FigureSpec("ring_allreduce_steps", "ch02", False, _ring_steps),
    FigureSpec("allreduce_bandwidth", "ch02", True, _allreduce_bandwidth),
    FigureSpec("device_map_12_on_5", "ch03", False, _device_map_12_on_5),
    FigureSpec("model_parallel_timeline", "ch03", True, _model_parallel_timeline),
    FigureSpec("memory_llama2_7b_v100", "ch03", False, _memory_llama2_7b_v100),
    FigureSpec("pipeline_schedules", "ch04", False, _pipeline_schedules),
    FigureSpec("pipeline_animation", "ch04", False, lambda: _pipeline_schedules((0.2, 0.4, 0.6, 0.8))),
    FigureSpec("strategy_options_llama2_7b", "ch05", False, _strategy_options),
    FigureSpec("strategy_decision_map", "ch05", False, _strategy_decision_map),
    FigureSpec("zero_memory_census", "ch06", True, _zero_census),
    FigureSpec("zero_calculator_7b", "ch06", False, _zero_calculator),
    FigureSpec("zero3_timeline", "ch06", True, _zero3_timeline),
    FigureSpec("tp_layer_steps", "ch07", False, _tp_layer_steps),
    FigureSpec("tp_step_times", "ch07", True, _tp_step_times),
    FigureSpec("pipeline_schedules_ch08", "ch08", False, _schedule_zoo),
    FigureSpec("inference_calculator", "ch09", False, _inference_calculator),
    FigureSpec("inference_roofline", "ch09", False, _inference_roofline),
    FigureSpec("inference_timelines", "ch09", True, _inference_timelines),
    FigureSpec("pipeline_v_schedules_ch08", "ch08", False, _v_schedules),
    FigureSpec("grid3d_2x2x2", "ch10", False, _grid3d),
    FigureSpec("planner_widget_ch10", "ch10", False, _planner_widget),
    FigureSpec("ring_attention", "ch11", False, _ring_attention),
    FigureSpec("moe_all_to_all", "ch12", False, _moe_all_to_all),
    FigureSpec("serving_steps", "ch13", False, _serving_steps),
]


def select(only: Optional[Sequence[str]] = None, static: bool = False) -> list[FigureSpec]:
    """The entries named by ``only`` (stems or chapters such as "ch04"; all when empty).

    Raises:
        ValueError: a name in ``only`` that is neither a stem nor a chapter.
    """
    known = {f.stem for f in FIGURES} | {f.chapter for f in FIGURES}
    unknown = sorted(set(only or ()) - known)
    if unknown:
        raise ValueError(f"only must name figure stems or chapters, got {unknown}; known: {sorted(known)}")
    return [f for f in FIGURES
            if (not only or f.stem in only or f.chapter in only) and not (static and f.measured)]


def collect(only: Optional[Sequence[str]] = None, static: bool = False) -> dict[str, Figure]:
    """``{stem: figure}`` for the selected entries (see :func:`select`)."""
    return {spec.stem: spec.make() for spec in select(only, static)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNG files")
    parser.add_argument("--only", nargs="*", help="figure stems or chapters (ch00..ch13) to make (default: all)")
    parser.add_argument("--static", action="store_true", help="skip the figures measured on this machine")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in select(args.only, args.static):
        fig = spec.make()
        path = args.out / f"{spec.stem}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
