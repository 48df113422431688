"""The chapters' GPU checks that ``python -m parallel_lib.check_gpu`` runs, one function per chapter.

Each check runs a chapter's key result on the devices it is given and returns its table(s)
as Markdown: the equivalence with one device or one process (a ``CheckError`` when it does
not hold), then the chapter's measurement. The same functions run on CPU "devices" (gloo
ranks, int device keys on a machine without GPUs), which is how the tests check them.
Every timer waits on the devices it timed, and only those
(:class:`~parallel_lib.common.timeline.DeviceClock`).
"""

from __future__ import annotations

import copy
import gc
import statistics
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from parallel_lib.bench import allreduce as bench_allreduce
from parallel_lib.bench import dp as bench_dp
from parallel_lib.bench import pp as bench_pp
from parallel_lib.common.models import build_gpt2
from parallel_lib.common.tables import markdown_table
from parallel_lib.common.timeline import DeviceClock
from parallel_lib.common.training import forward_loss, train, weighted_cross_entropy
from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer
from parallel_lib.data_parallel.dp import DPConfig, run_dp_many
from parallel_lib.data_parallel.dp_reference import single_process_reference
from parallel_lib.model_parallel.device_map import get_device_map
from parallel_lib.model_parallel.placing import parallelize
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.pipe import Pipe
from parallel_lib.runtime.device import resolve_device
from parallel_lib.runtime.launcher import launch

__all__ = ["CheckError", "Workload", "FULL", "QUICK", "workload_for", "device_counts", "free_memory", "check_dp",
           "check_allreduce", "check_model_parallel", "check_pipeline"]

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


def workload_for(quick: bool) -> Workload:
    """The quick or the full workload."""
    return QUICK if quick else FULL


def device_counts(n_devices: int, n_layers: int) -> list[int]:
    """How many devices to split a model over: 1, 2, 4, ... and all of them (at most one per layer)."""
    most = min(n_devices, n_layers)
    return sorted({k for k in (2**i for i in range(most.bit_length())) if k <= most} | {most})


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


def _reference(workload: Workload) -> tuple[list[Batch], nn.Module, Grads]:
    """The batches, the one-device GPT-2 every split is compared with, and its gradients on ``cuda:0``."""
    vocab_size, batches = _batches(workload)
    reference = build_gpt2(workload.model, vocab_size=vocab_size)
    first = resolve_device(0)
    return batches, reference, _loss_and_grads(copy.deepcopy(reference).to(first), batches[0], first)


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


def free_memory() -> None:
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
    reference = (torch.tensor(expected_record.losses), expected)
    rows = []
    for k, method in enumerate(methods):
        worst = max(_max_difference(reference, (torch.tensor(runs[k].record.losses), runs[k].state or {}),
                                    f"sync={method!r} on rank {runs[k].rank}") for runs in per_rank)
        identical = len({runs[k].checksum for runs in per_rank}) == 1
        rows.append([method, f"{worst:.1e}", "yes" if identical else "no"])
    table = markdown_table(["sync", "max abs parameter difference", "ranks bit-identical"], rows, "lrl")
    results = bench_dp.measure(replace(bench_dp.QUICK if quick else bench_dp.Config(), world_size=n_gpus))
    return "\n".join([f"Data parallel, {n_gpus} ranks on {per_rank[0][0].device} .. {per_rank[-1][0].device}, "
                      f"{expected_record.steps} SGD steps: every sync method's parameters match one process "
                      "on the CPU's:", "", table, "", bench_dp.markdown(results)])


def check_allreduce(n_gpus: int, quick: bool = False) -> str:
    """The all-reduce benchmark over ``n_gpus`` ranks; the ring must agree with the built-in."""
    results = bench_allreduce.measure(replace(bench_allreduce.QUICK if quick else bench_allreduce.Config(),
                                              world_size=n_gpus))
    if not results.max_error < 1e-3:  # float sums in another order differ by ~1e-6 here
        raise CheckError(f"ring_all_reduce differs from dist.all_reduce by {results.max_error:.3g}")
    return bench_allreduce.markdown(results)


def _model_parallel_row(reference: nn.Module, expected: Grads, batches: list[Batch], k: int) -> list[object]:
    """GPT-2 split over ``k`` devices: (devices, layers per device, max grad difference, tokens/s)."""
    device_map = get_device_map(reference.config.n_layer, list(range(k)))
    model = parallelize(copy.deepcopy(reference), device_map)
    first = resolve_device(0)
    difference = _max_difference(expected, _loss_and_grads(model, batches[0], first), f"{k} devices")
    record = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, progress=False, device=first)
    devices = ", ".join(str(resolve_device(key)) for key in device_map)
    layers = "+".join(str(len(v)) for v in device_map.values())
    return [devices, layers, f"{difference:.1e}", record.throughput(skip=1)]  # step 0 warms up kernels


def check_model_parallel(n_gpus: int, quick: bool = False) -> str:
    """GPT-2 split over 1, 2, 4, ... devices by a device map: same gradients as one device, tokens/s."""
    workload = workload_for(quick)
    batches, reference, expected = _reference(workload)
    rows = []
    for k in device_counts(n_gpus, reference.config.n_layer):
        rows.append(_model_parallel_row(reference, expected, batches, k))  # the split model is freed on return
        free_memory()
    baseline = rows[0][3]
    table = markdown_table(["devices", "layers per device", "max abs grad diff vs 1 device", "target tokens/s",
                            "× 1 device"],
                           [row[:3] + [f"{row[3]:,.0f}", f"{row[3] / baseline:.2f}×"] for row in rows], "llrrr")
    return "\n".join([f"Model parallelism, GPT-2 ({workload.model}) split by get_device_map, {workload.rows} rows x "
                      f"{workload.length} positions, AdamW, {workload.steps} timed steps.", "", table])


def _pipeline_on(p: int, reference: nn.Module, expected: Grads, batch: Batch, workload: Workload
                 ) -> tuple[list[list[object]], list[list[object]]]:
    """Pipe over ``p`` devices: (equivalence rows per schedule, GPipe timing rows per micro-batch count)."""
    ids, target = batch["input_ids"], (batch["labels"], batch["label_token_weights"])
    loss_fn = partial(weighted_cross_entropy, denominator=batch["label_token_weights"].sum())
    tokens = int(batch["label_token_weights"].sum())
    model = copy.deepcopy(reference)
    stages = gpt2_stages(model, list(range(p)))
    matches = []
    for schedule in ("gpipe", "1f1b"):
        with Pipe(stages, stages.devices, chunks=min(4, workload.rows), schedule=schedule) as pipe:
            stages.zero_grad(set_to_none=True)
            got = _grads(model, pipe.train_step(ids, target, loss_fn, reduction="sum"))
        devices = ", ".join(map(str, pipe.devices))
        matches.append([devices, schedule, f"{_max_difference(expected, got, f'Pipe {schedule} on {devices}'):.1e}"])
    timings, step_seconds = [], {}
    for m in workload.micro_batches:
        with Pipe(stages, stages.devices, chunks=m, schedule="gpipe") as pipe:
            clock = DeviceClock(pipe.devices)  # kernels run after the call returns: wait on every stage's device
            times = []
            for _ in range(workload.repeats):
                stages.zero_grad(set_to_none=True)
                start = clock()
                pipe.train_step(ids, target, loss_fn, reduction="sum")
                times.append(clock() - start)
        step_seconds[m] = statistics.median(times[1:])  # the first step warms up
        speedup = step_seconds[workload.micro_batches[0]] / step_seconds[m]
        timings.append([p, m, f"{step_seconds[m] * 1e3:.1f}", f"{tokens / step_seconds[m]:,.0f}", f"{speedup:.2f}×",
                        f"{bench_pp.ideal(m, p):.2f}×"])
    return matches, timings


def check_pipeline(n_gpus: int, quick: bool = False) -> str:
    """Pipe over 2, 4, ... devices: same gradients as one device, GPipe step times; then the PP benchmark."""
    workload = workload_for(quick)
    batches, reference, expected = _reference(workload)
    matches, timings = [], []
    for p in [k for k in device_counts(n_gpus, reference.config.n_layer) if k >= 2]:
        rows = _pipeline_on(p, reference, expected, batches[0], workload)  # stages are freed on return
        matches += rows[0]
        timings += rows[1]
        free_memory()
    results = bench_pp.run(bench_pp.QUICK if quick else bench_pp.Config())
    return "\n".join([
        f"Pipeline parallelism, GPT-2 ({workload.model}) cut by gpt2_stages, {workload.rows} rows x "
        f"{workload.length} positions; loss and gradients against one device:", "",
        markdown_table(["devices", "schedule", "max abs difference"], matches, "llr"), "",
        f"GPipe training step, median of {workload.repeats - 1} timed step(s) after a warm-up:", "",
        markdown_table(["stages", "m", "ms / step", "target tokens/s", f"speedup vs m={workload.micro_batches[0]}",
                        "ideal p·m/(m+p−1)"], timings, "rrrrrr"), "",
        bench_pp.markdown(results)])


# --------------------------------------------------------------------------- chapter 06
