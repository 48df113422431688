"""Run the chapters' key measurements on NVIDIA GPUs: ``python -m parallel_lib.check_gpu [--quick]``.

The notebooks and benchmarks run everywhere on CPU ranks and CPU "devices"; the
same code picks up GPUs when they are there (``launch`` chooses NCCL, int device
keys resolve to ``cuda:k``). This script is the one command a reader with GPUs
runs to see that happen, chapter by chapter, with the same checks and tables:

- ``dp`` (>= 2 GPUs): every gradient-sync method over one NCCL rank per GPU
  trains like one process, then ``python -m parallel_lib.bench dp``'s table;
- ``allreduce`` (>= 2 GPUs): ``bench allreduce``'s table, ring vs NCCL;
- ``model_parallel`` (>= 1 GPU): GPT-2 split over ``cuda:0 .. cuda:k-1`` by a
  device map gives the gradients of one GPU, and its tokens/s;
- ``pipeline`` (>= 2 GPUs): ``Pipe`` over ``cuda:0 .. cuda:p-1`` gives the
  gradients of one GPU, GPipe step times by micro-batch count, then
  ``bench pp``'s table (threads vs ``torch.distributed.pipelining`` on NCCL).

A check that fails is reported and the others still run. Exit status: 0 when
every planned check passed, and also on a machine without a GPU (it says so and
checks nothing); 1 when a check failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from parallel_lib.bench import allreduce as bench_allreduce
from parallel_lib.bench import dp as bench_dp
from parallel_lib.bench import pp as bench_pp
from parallel_lib.common.models import GPT2_SIZES, build_gpt2
from parallel_lib.common.timeline import synchronize_devices
from parallel_lib.common.training import forward_loss, train, weighted_cross_entropy
from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer
from parallel_lib.data_parallel.dp import DPConfig, run_dp_many, single_process_reference
from parallel_lib.model_parallel.device_map import get_device_map
from parallel_lib.model_parallel.placing import parallelize
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.pipe import Pipe
from parallel_lib.runtime.device import resolve_device
from parallel_lib.runtime.environment import environment_report
from parallel_lib.runtime.launcher import launch

__all__ = ["CHECKS", "CheckError", "Workload", "FULL", "QUICK", "Planned", "device_counts", "plan",
           "format_plan", "check_dp", "check_allreduce", "check_model_parallel", "check_pipeline",
           "parse_args", "main"]

Batch = dict[str, torch.Tensor]
Grads = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (loss, gradient or parameter by name), on the CPU

# one forward/backward on other devices vs one device: the same kernels, summed in another order
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


class CheckError(RuntimeError):
    """A check ran but its result is wrong (e.g. split training differs from one device)."""


@dataclass(frozen=True)
class Workload:
    """The model and batches of the in-process checks (model parallel, pipeline)."""

    model: str = "gpt2"                # a GPT2_SIZES name; "gpt2" is the 124M shape
    rows: int = 32                     # rows per batch
    length: int = 128                  # positions per row, every row padded to it
    steps: int = 10                    # training steps timed per device map, after one warm-up
    repeats: int = 4                   # pipeline steps timed per micro-batch count, after one warm-up
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    vocab_size: int = 2048


FULL = Workload()
QUICK = Workload(model="tiny", rows=8, length=32, steps=3, repeats=2, micro_batches=(1, 2, 4), vocab_size=300)


def _workload(quick: bool) -> Workload:
    return QUICK if quick else FULL


# --------------------------------------------------------------------------- plan


def device_counts(n_devices: int, n_layers: int) -> list[int]:
    """How many devices to split a model over: 1, 2, 4, ... and all of them (at most one per layer)."""
    most = min(n_devices, n_layers)
    return sorted({k for k in (2**i for i in range(most.bit_length())) if k <= most} | {most})


@dataclass(frozen=True)
class Planned:
    """One check as it will run here: on how many GPUs, or why it is skipped."""

    name: str
    gpus: int     # GPUs the check uses; 0 when skipped
    reason: str   # why it is skipped ("" when it runs)

    @property
    def runs(self) -> bool:
        return not self.reason


def plan(n_gpus: int, quick: bool = False, only: Optional[Sequence[str]] = None) -> list[Planned]:
    """Which checks run with ``n_gpus`` GPUs, in chapter order.

    Raises:
        ValueError: a name in ``only`` that is not one of ``CHECKS``.
    """
    unknown = [name for name in only or () if name not in CHECKS]
    if unknown:
        raise ValueError(f"only must name checks from {list(CHECKS)}, got {unknown}")
    n_layers = GPT2_SIZES[_workload(quick).model]["n_layer"]
    planned = []
    for name, (min_gpus, _, _) in CHECKS.items():
        if only and name not in only:
            planned.append(Planned(name, 0, "not selected (--only)"))
        elif n_gpus < min_gpus:
            planned.append(Planned(name, 0, f"needs >= {min_gpus} GPU{'s' * (min_gpus > 1)}, found {n_gpus}"))
        else:
            in_process = name in ("model_parallel", "pipeline")  # one model split over devices: <= 1 per layer
            planned.append(Planned(name, max(device_counts(n_gpus, n_layers)) if in_process else n_gpus, ""))
    return planned


def format_plan(planned: Sequence[Planned]) -> str:
    """The plan as a table: check, GPUs, what it does or why it is skipped."""
    lines = [f"{'check':<15} {'GPUs':>4}  what"]
    for p in planned:
        what = CHECKS[p.name][1] if p.runs else f"skipped: {p.reason}"
        lines.append(f"{p.name:<15} {p.gpus if p.runs else '-':>4}  {what}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- shared pieces


def _batches(workload: Workload) -> tuple[int, list[Batch]]:
    """(vocabulary size, ``steps + 1`` batches of ``rows`` x ``length`` from the built-in corpus)."""
    pairs = load_corpus("train", size=workload.rows * (workload.steps + 1))
    tokenizer = get_tokenizer(pairs, vocab_size=workload.vocab_size)
    return len(tokenizer), [collate_batch(pairs[i:i + workload.rows], "de", "en", tokenizer, workload.length,
                                          pad_to_max_length=True) for i in range(0, len(pairs), workload.rows)]


def _grads(model: nn.Module, loss: torch.Tensor) -> Grads:
    return loss.detach().cpu(), {name: p.grad.detach().cpu() for name, p in model.named_parameters()
                                 if p.grad is not None}


def _loss_and_grads(model: nn.Module, batch: Batch, device: torch.device) -> Grads:
    """One forward and backward of ``model`` on ``batch`` (moved to ``device``)."""
    model.zero_grad(set_to_none=True)
    loss = forward_loss(model, {k: v.to(device) for k, v in batch.items()})
    loss.backward()
    return _grads(model, loss)


def _max_difference(expected: Grads, got: Grads, what: str) -> float:
    """Largest |difference| of the named tensors; raises ``CheckError`` if the loss or one of them is off."""
    try:
        torch.testing.assert_close(got[0], expected[0], **TOLERANCE, msg=lambda m: f"loss: {m}")
        assert got[1].keys() == expected[1].keys(), "the parameter names differ"
        for name, grad in expected[1].items():
            torch.testing.assert_close(got[1][name], grad, **TOLERANCE, msg=lambda m: f"{name}: {m}")
    except AssertionError as e:
        raise CheckError(f"{what} does not match the reference: {e}") from None
    return max((got[1][name] - grad).abs().max().item() for name, grad in expected[1].items())


def _free() -> None:
    """Give cached GPU memory back between checks (the next one may launch processes)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- checks


def check_dp(n_gpus: int, quick: bool = False) -> str:
    """Each sync method on ``n_gpus`` ranks trains like one process; then the DP benchmark."""
    methods = ("naive", "bucketed", "ring", "ddp")
    # SGD: a parameter's update is proportional to its gradient, so float noise stays noise
    # (Adam would blow a near-zero gradient's noise up to a full step) while a missed sync does not
    config = DPConfig(model="tiny", batch_size=4 * n_gpus, max_steps=3, train_examples=12 * n_gpus,
                      val_examples=8, vocab_size=300, max_length=32, optimizer="sgd", lr=0.1, return_state=True)
    per_rank = launch(run_dp_many, n_gpus, [replace(config, sync=m) for m in methods], timeout=300)
    expected_record, expected = single_process_reference(n_gpus, config)
    lines = [f"Data parallel, {n_gpus} ranks on {per_rank[0][0].device} .. {per_rank[-1][0].device}, "
             f"{expected_record.steps} SGD steps vs one process on the CPU:", ""]
    reference = (torch.tensor(expected_record.losses), expected)
    for k, method in enumerate(methods):
        worst = max(_max_difference(reference, (torch.tensor(runs[k].record.losses), runs[k].state or {}),
                                    f"sync={method!r} on rank {runs[k].rank}") for runs in per_rank)
        identical = len({runs[k].checksum for runs in per_rank}) == 1
        lines.append(f"  {method:<9} parameters match (max |difference| {worst:.1e}), "
                     f"ranks bit-identical: {'yes' if identical else 'no'}")
    results = bench_dp.measure(replace(bench_dp.QUICK if quick else bench_dp.Config(), world_size=n_gpus))
    return "\n".join(lines + ["", bench_dp.markdown(results)])


def check_allreduce(n_gpus: int, quick: bool = False) -> str:
    """The all-reduce benchmark over ``n_gpus`` ranks; the ring must agree with the built-in."""
    results = bench_allreduce.measure(replace(bench_allreduce.QUICK if quick else bench_allreduce.Config(),
                                              world_size=n_gpus))
    if not results.max_error < 1e-3:  # float sums in another order differ by ~1e-6 here
        raise CheckError(f"ring_all_reduce differs from dist.all_reduce by {results.max_error:.3g}")
    return bench_allreduce.markdown(results)


def check_model_parallel(n_gpus: int, quick: bool = False) -> str:
    """GPT-2 split over 1, 2, 4, ... devices by a device map: same gradients as one device, tokens/s."""
    workload = _workload(quick)
    vocab_size, batches = _batches(workload)
    reference = build_gpt2(workload.model, vocab_size=vocab_size)
    n_layers, first = reference.config.n_layer, resolve_device(0)
    expected = _loss_and_grads(copy.deepcopy(reference).to(first), batches[0], first)
    lines = [f"Model parallelism, GPT-2 ({workload.model}) split by get_device_map, {workload.rows} rows x "
             f"{workload.length} positions, AdamW, {workload.steps} timed steps.", "",
             "| devices | layers per device | max abs grad diff vs 1 device | target tokens/s | × 1 device |",
             "|---|---|---:|---:|---:|"]
    baseline = None
    for k in device_counts(n_gpus, n_layers):
        device_map = get_device_map(n_layers, list(range(k)))
        model = parallelize(copy.deepcopy(reference), device_map)
        difference = _max_difference(expected, _loss_and_grads(model, batches[0], first), f"{k} devices")
        record = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, progress=False, device=first)
        rate = record.throughput(skip=1)  # step 0 warms up kernels and the allocator
        baseline = baseline or rate
        devices = ", ".join(str(resolve_device(key)) for key in device_map)
        lines.append(f"| {devices} | {'+'.join(str(len(v)) for v in device_map.values())} | {difference:.1e} | "
                     f"{rate:,.0f} | {rate / baseline:.2f}× |")
        del model
        _free()
    return "\n".join(lines)


def check_pipeline(n_gpus: int, quick: bool = False) -> str:
    """Pipe over 2, 4, ... devices: same gradients as one device, GPipe step times; then the PP benchmark."""
    workload = _workload(quick)
    vocab_size, batches = _batches(workload)
    batch = batches[0]
    ids, target = batch["input_ids"], (batch["labels"], batch["label_token_weights"])
    loss_fn = partial(weighted_cross_entropy, denominator=batch["label_token_weights"].sum())
    tokens = int(batch["label_token_weights"].sum())
    reference = build_gpt2(workload.model, vocab_size=vocab_size)
    first = resolve_device(0)
    expected = _loss_and_grads(copy.deepcopy(reference).to(first), batch, first)
    checks, rows = [], []
    for p in [k for k in device_counts(n_gpus, reference.config.n_layer) if k >= 2]:
        model = copy.deepcopy(reference)
        stages = gpt2_stages(model, list(range(p)))
        for schedule in ("gpipe", "1f1b"):
            with Pipe(stages, stages.devices, chunks=min(4, workload.rows), schedule=schedule) as pipe:
                stages.zero_grad(set_to_none=True)
                got = _grads(model, pipe.train_step(ids, target, loss_fn, reduction="sum"))
            what = f"Pipe {schedule} on {', '.join(map(str, pipe.devices))}"
            checks.append(f"{what}: loss and gradients match one device (max |difference| "
                          f"{_max_difference(expected, got, what):.1e})")
        step_seconds: dict[int, float] = {}
        for m in workload.micro_batches:
            with Pipe(stages, stages.devices, chunks=m, schedule="gpipe") as pipe:
                times = []
                for _ in range(workload.repeats):
                    stages.zero_grad(set_to_none=True)
                    start = time.perf_counter()
                    pipe.train_step(ids, target, loss_fn, reduction="sum")
                    synchronize_devices(pipe.devices)  # kernels run after the call returns; wait on every stage
                    times.append(time.perf_counter() - start)
            step_seconds[m] = statistics.median(times[1:])  # the first step warms up
            speedup = step_seconds[workload.micro_batches[0]] / step_seconds[m]
            rows.append(f"| {p} | {m} | {step_seconds[m] * 1e3:.1f} | {tokens / step_seconds[m]:,.0f} | "
                        f"{speedup:.2f}× | {bench_pp.ideal(m, p):.2f}× |")
        del model, stages
        _free()
    lines = [f"Pipeline parallelism, GPT-2 ({workload.model}) cut by gpt2_stages, {workload.rows} rows x "
             f"{workload.length} positions.", "", *checks, "",
             f"GPipe training step, median of {workload.repeats - 1} timed step(s) after a warm-up:", "",
             f"| stages | m | ms / step | target tokens/s | speedup vs m={workload.micro_batches[0]} | "
             "ideal p·m/(m+p−1) |", "|---:|---:|---:|---:|---:|---:|", *rows]
    results = bench_pp.run(bench_pp.QUICK if quick else bench_pp.Config())
    return "\n".join(lines + ["", bench_pp.markdown(results)])


# name -> (GPUs needed, what it does, the check)
CHECKS: dict[str, tuple[int, str, Callable[[int, bool], str]]] = {
    "dp": (2, "data parallel on NCCL ranks: equivalence with one process, bench dp", check_dp),
    "allreduce": (2, "ring vs dist.all_reduce on NCCL: bench allreduce", check_allreduce),
    "model_parallel": (1, "GPT-2 over cuda:0..k-1 device maps: equivalence with one GPU, tokens/s",
                       check_model_parallel),
    "pipeline": (2, "Pipe over cuda:0..p-1: equivalence with one GPU, step times by m, bench pp", check_pipeline),
}


# --------------------------------------------------------------------------- command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """``--quick``, ``--only NAME ...`` and ``--gpus N``."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.check_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps and repeats: a smoke run")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), metavar="CHECK",
                        help=f"run only these checks, from {list(CHECKS)}")
    parser.add_argument("--gpus", type=int, help="use the first N GPUs (default: all visible)")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    return args


def _no_gpu_message() -> str:
    build = (f"this torch {torch.__version__} is built with CUDA {torch.version.cuda}, but no GPU is visible "
             "(check nvidia-smi and CUDA_VISIBLE_DEVICES)" if torch.version.cuda else
             f"this torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)")
    return (f"No NVIDIA GPU found: {build}. Nothing to check on GPUs here. The same runs on CPU: "
            "the notebooks, and python -m parallel_lib.bench dp|allreduce|pp.")


def main(argv: Optional[list[str]] = None) -> int:
    """Run the planned checks one after another; 0 when all pass (or there is no GPU), else 1."""
    args = parse_args(argv)
    visible = torch.cuda.device_count()
    if visible == 0:
        print(_no_gpu_message())
        return 0
    if args.gpus is not None and args.gpus > visible:
        print(f"--gpus {args.gpus} asks for more GPUs than the {visible} visible", file=sys.stderr)
        return 2
    planned = plan(args.gpus or visible, args.quick, args.only)
    environment_report()
    print("\n" + format_plan(planned))
    outcomes = []
    for step in (p for p in planned if p.runs):
        print(f"\n## {step.name} on {step.gpus} GPU{'s' * (step.gpus > 1)}\n", flush=True)
        start = time.perf_counter()
        try:
            print(CHECKS[step.name][2](step.gpus, args.quick))
            status = "passed"
        except Exception:  # report it and go on: the other chapters' checks still tell something
            traceback.print_exc()
            status = "FAILED"
        _free()
        outcomes.append((step.name, status, time.perf_counter() - start))
    print("\n" + "\n".join(f"{name:<15} {status:<7} {seconds:7.1f} s" for name, status, seconds in outcomes))
    return 1 if any(status == "FAILED" for _, status, _ in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
