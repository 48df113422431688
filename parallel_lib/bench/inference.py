"""Serving benchmark: ``python -m parallel_lib.bench inference [--quick] [--repeats N] [--max-world 4]``.

One run prints, for this machine:

1. **every strategy × ranks × concurrency**: single, and dp, mp, pp, tp on 2 (and 4) ranks, at
   1, 2, 4, 8, 16 requests arriving together: mean time to first token (TTFT), mean time per
   output token (TPOT), aggregate tokens/s, weights and KV cache on the fullest device (tensor
   census), and the cost model's prediction beside each (:mod:`parallel_lib.inference.cost_model`,
   with this machine's FLOP/s and bandwidth, the fitted gloo all-reduce, and one overhead constant
   calibrated on the single device at concurrency 1);
2. **the TP crossover**: single vs tp = 2 decode latency for the course's GPT-2 sizes, measured and
   predicted, and the width from which the model predicts tp to pay on this machine;
3. **the source article's claims** (Tushar Vatsa, "LLM Inference: Data Parallel, Model Parallel, and
   Pipeline Parallel", Towards AI) beside what the rows above measured.

Every rank runs with one thread; ranks are launched once per world size and run every job in turn
(:mod:`parallel_lib.bench._inference_runs`). Each job runs ``--repeats`` times; the median run (by
tokens/s) is reported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Optional

from parallel_lib.bench import repeats as repeats_type
from parallel_lib.bench._inference_runs import Job, Measured, launch_jobs, make_requests, measured, median_runs
from parallel_lib.common.tables import markdown_table
from parallel_lib.inference.cost_model import (Hardware, Prediction, Workload, calibrate_overhead,
                                               hardware_from_speed, predict, tp_crossover_width)
from parallel_lib.inference.strategies import ServeConfig
from parallel_lib.runtime.environment import machine_label

__all__ = ["Config", "QUICK", "Results", "measure", "predictions", "markdown", "article_rows", "ARTICLE", "main",
           # the serving runs this benchmark makes, for chapter 09 to make its own (from _inference_runs)
           "Job", "Measured", "launch_jobs", "make_requests", "measured", "median_runs"]

# The source article's inference claims: its own words where the text was available (DP), else the
# comparison table chapter 05 records from it (parallel_lib.planner.compare.CLASSIC).
ARTICLE = {
    "dp": "\"by processing different data batches in parallel, we can ideally speed up inference by the number "
          "of available devices\"",
    "mp": "the model divided by the devices; no faster than one device",
    "pp": "the model divided by the devices; throughput close to p × once the batches in flight fill the pipe",
}


@dataclass(frozen=True)
class Config:
    """What is measured."""

    model: str = "tiny"
    vocab_size: int = 512
    prompt: int = 16
    new_tokens: int = 16
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    worlds: tuple[int, ...] = (2, 4)
    strategies: tuple[str, ...] = ("dp", "mp", "pp", "tp")
    crossover_models: tuple[str, ...] = ("tiny", "small", "gpt2")
    crossover_tokens: int = 8
    repeats: int = 3
    timeout: float = 600.0

    def serve_config(self, model: Optional[str] = None) -> ServeConfig:
        # a larger init than GPT-2's 0.02: a random model then does not repeat one token (as the engine's tests)
        return ServeConfig(model or self.model, self.vocab_size, 0, 0.2, max(self.concurrency), 0)


QUICK = Config(concurrency=(1, 2), worlds=(2,), new_tokens=4, prompt=8, crossover_models=("tiny",),
               crossover_tokens=3, repeats=1, timeout=300.0)


@dataclass
class Results:
    """Measured runs keyed by (strategy, world, concurrency), the crossover runs, and the machine."""

    config: Config
    machine: str
    hardware: Hardware                                   # calibrated
    runs: dict[tuple[str, int, int], Measured] = field(default_factory=dict)
    crossover: dict[tuple[str, str], Measured] = field(default_factory=dict)   # (model, "single"/"tp")


def _jobs(c: Config, world: int) -> list[tuple[tuple, Job]]:
    jobs = []
    for n in c.concurrency:
        requests = make_requests(n, c.prompt, c.new_tokens, c.vocab_size, seed=n)
        names = (["single"] if world == min(c.worlds) else []) + list(c.strategies)
        jobs += [((s, 1 if s == "single" else world, n), Job(s, 1 if s == "single" else world, requests,
                                                               c.serve_config())) for s in names]
    if world == 2:
        for model in c.crossover_models:
            requests = make_requests(1, c.prompt, c.crossover_tokens, c.vocab_size)
            jobs += [(("x", model, s), Job(s, 1 if s == "single" else 2, requests, c.serve_config(model)))
                     for s in ("single", "tp")]
    return jobs


def measure(config: Config = Config()) -> Results:
    """One launch per world size running every job ``repeats`` times (after a warm-up job); see the module docstring."""
    c = config
    best: dict[tuple, Measured] = {}
    fitted, speed = None, None
    for world in c.worlds:
        keyed = _jobs(c, world)
        jobs = [job for _, job in keyed]
        served, fit, measured_speed = launch_jobs(jobs * c.repeats, world, world == 2, world == 2, c.timeout)
        fitted, speed = fit or fitted, measured_speed or speed
        best.update({key: measured(run) for (key, _), run in zip(keyed, median_runs(jobs, served, c.repeats))})
    assert fitted is not None and speed is not None, "the world-size-2 launch measures the machine"
    hw = hardware_from_speed(speed, 0.0, fitted[0], fitted[1], name=machine_label())
    single = best[("single", 1, 1)]
    hw = calibrate_overhead(c.serve_config().config(), hw, single.tpot, Workload(c.prompt, c.new_tokens, 1))
    results = Results(c, machine_label(), hw)
    for key, m in best.items():
        if key[0] == "x":
            results.crossover[(key[1], key[2])] = m
        else:
            results.runs[key] = m
    return results


def predictions(results: Results) -> dict[tuple[str, int, int], Prediction]:
    """The cost model's prediction for every measured run."""
    c = results.config
    model = c.serve_config().config()
    return {key: predict(model, key[0], key[1], Workload(c.prompt, c.new_tokens, key[2]), results.hardware)
            for key in results.runs}


def article_rows(results: Results) -> list[list[str]]:
    """``[strategy, what the article says, what was measured here]`` for dp, mp, pp (at 2 ranks)."""
    r, top = results.runs, max(results.config.concurrency)
    base = {n: r[("single", 1, n)].tokens_per_second for n in (1, top)}
    ratio = {s: {n: r[(s, 2, n)].tokens_per_second / base[n] for n in (1, top)} for s in ("dp", "mp", "pp")}
    kv = r[("mp", 2, 1)].weights_per_device / r[("single", 1, 1)].weights_per_device
    return [["DP", ARTICLE["dp"], f"2 ranks: {ratio['dp'][1]:.2f}× one device's tokens/s at 1 request, "
             f"{ratio['dp'][top]:.2f}× at {top}; TTFT {r[('dp', 2, top)].ttft * 1e3:.1f} ms vs "
             f"{r[('single', 1, top)].ttft * 1e3:.1f} ms"],
            ["MP", ARTICLE["mp"], f"weights {kv:.2f}× one device's on the fullest device; tokens/s "
             f"{ratio['mp'][1]:.2f}× at 1 request, {ratio['mp'][top]:.2f}× at {top}"],
            ["PP", ARTICLE["pp"], f"tokens/s {ratio['pp'][1]:.2f}× one device's at 1 request (fewer requests than "
             f"stages), {ratio['pp'][top]:.2f}× at {top}; TPOT at 1 request {r[('pp', 2, 1)].tpot * 1e3:.2f} ms vs "
             f"{r[('single', 1, 1)].tpot * 1e3:.2f} ms"]]


def markdown(results: Results) -> str:
    """The three tables, labelled with the machine and the constants the predictions use."""
    c, hw = results.config, results.hardware
    pred = predictions(results)
    rows = []
    for key in sorted(results.runs, key=lambda k: (k[0] != "single", k[0], k[1], k[2])):
        m, p = results.runs[key], pred[key]
        rows.append([key[0], key[1], key[2], f"{m.ttft * 1e3:.2f} ({p.ttft * 1e3:.2f})",
                     f"{m.tpot * 1e3:.2f} ({p.tpot * 1e3:.2f})",
                     f"{m.tokens_per_second:,.0f} ({p.tokens_per_second:,.0f})",
                     f"{m.weights_per_device / 1e3:,.0f}", f"{m.kv_per_device / 1e3:,.0f}"])
    out = [f"Serving GPT-2 {c.model!r} (vocabulary {c.vocab_size}) on {results.machine}: prompts of {c.prompt} "
           f"tokens, {c.new_tokens} new tokens each, greedy, one thread per rank, median of {c.repeats}; "
           f"prediction in brackets from {hw.flops_per_second / 1e9:.1f} GFLOP/s, "
           f"{hw.bytes_per_second / 1e9:.1f} GB/s, gloo {hw.link_bandwidth / 1e9:.2f} GB/s + "
           f"{hw.link_latency * 1e6:.0f} µs per message, overhead {hw.overhead * 1e6:.0f} µs per layer and "
           "forward (calibrated on single at concurrency 1)", "",
           markdown_table(["strategy", "ranks", "concurrency", "TTFT ms", "TPOT ms", "tokens/s", "weights kB/device",
                           "KV cache kB/device"], rows, "lrrrrrrr")]
    if results.crossover:
        x_rows, first = [], None
        for model in c.crossover_models:
            one, tp = results.crossover[(model, "single")], results.crossover[(model, "tp")]
            shape = c.serve_config(model).config()
            w = Workload(c.prompt, c.crossover_tokens, 1)
            p1, p2 = (predict(shape, s, n, w, hw).tpot for s, n in (("single", 1), ("tp", 2)))
            first = first or (model if tp.tpot < one.tpot else None)
            x_rows.append([model, shape.n_embd, shape.n_layer, f"{one.tpot * 1e3:.2f}", f"{tp.tpot * 1e3:.2f}",
                           f"{p1 * 1e3:.2f}", f"{p2 * 1e3:.2f}"])
        layers = c.serve_config(c.crossover_models[-1]).config().n_layer
        width = tp_crossover_width(hw, layers, 1, c.prompt, vocab=c.vocab_size)
        out += ["", "TP crossover: one request's decode latency, single vs tp = 2", "",
                markdown_table(["model", "width", "layers", "single TPOT ms", "tp=2 TPOT ms", "predicted single",
                                "predicted tp=2"], x_rows, "lrrrrrr"), "",
                f"- measured: tp = 2 first beats one device at {first or 'none of these sizes'}",
                f"- predicted ({layers} layers, heads of 64, this machine): from width {width or '> 8192'}"]
    if {("single", 1, 1), ("dp", 2, 1), ("mp", 2, 1), ("pp", 2, 1)} <= set(results.runs):
        out += ["", "The source article (Tushar Vatsa, \"LLM Inference: Data Parallel, Model Parallel, and Pipeline "
                "Parallel\", Towards AI) vs this run", "",
                markdown_table(["strategy", "the article", "measured here"], article_rows(results))]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.bench inference [--quick] [--repeats N] [--max-world N]``; prints the tables."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.bench inference", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 ranks, concurrency 1 and 2: a smoke run")
    parser.add_argument("--repeats", type=repeats_type, help="runs per job; the median is reported (default 3)")
    parser.add_argument("--max-world", type=int, choices=(2, 4), help="largest number of ranks (default 4)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    if args.repeats:
        config = replace(config, repeats=args.repeats)
    if args.max_world:
        config = replace(config, worlds=tuple(w for w in (2, 4) if w <= args.max_world))
    print(markdown(measure(config)))
    return 0

