"""Data, model and pipeline parallelism measured side by side: the comparison table, generated.

The classic article ends with a table (memory per device, throughput, communication,
when to use) filled in by hand. Here each row comes from a short run of the chapter's
own code on the same model, batches and machine:

- one device: :func:`parallel_lib.common.training.train` (the reference every chapter compares with);
- DP: chapter 01's data parallelism, the one training entry with ``Plan(dp=p, sync="bucketed")``
  (:func:`parallel_lib.training.train_layout`: gloo ranks, NCCL on GPUs);
- MP: chapter 03's :func:`parallel_lib.model_parallel.parallelize` and the same ``train`` loop;
- PP: chapter 04's :class:`parallel_lib.pipeline_parallel.Pipe` with 1F1B.

Memory per device is measured on the tensors (parameters, gradients, optimizer states,
by :func:`parallel_lib.model_parallel.memory.memory_report`) beside the estimate of
:func:`~parallel_lib.model_parallel.memory.training_memory`. Communication per device and step is
computed from the run's own tensor sizes with the planner's formulas
(:func:`parallel_lib.cost.alpha_beta.ring_wire_bytes` for the all-reduce, the hidden states that
cross each device boundary for MP and PP); chapter 05's DP×PP run counts its bytes
as it sends them and checks those formulas.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from parallel_lib.common import tables
from parallel_lib.common.models import build_gpt2, count_parameters
from parallel_lib.common.timeline import DeviceClock, idle_fraction
from parallel_lib.common.training import TrainRecord, forward_loss, train, weighted_cross_entropy
from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer
from parallel_lib.model_parallel.device_map import get_device_map
from parallel_lib.model_parallel.memory import memory_report, training_memory
from parallel_lib.model_parallel.placing import parallelize, placement
from parallel_lib.model_parallel.timeline import record_timeline
from parallel_lib.pipeline_parallel.gpt2 import gpt2_stages
from parallel_lib.pipeline_parallel.pipe import Pipe
from parallel_lib.cost.alpha_beta import ring_wire_bytes
from parallel_lib.planner.option import WHEN_TO_USE
from parallel_lib.runtime.device import devices, resolve_device
from parallel_lib.runtime.environment import machine_label
from parallel_lib.training import Plan, RunConfig, job_record, train_layout

__all__ = ["CompareConfig", "Measured", "CLASSIC", "measure", "markdown_table"]

# What the classic article's comparison table says, row by row, to hold against the measurements.
CLASSIC = {
    "DP": dict(memory="a full copy of the model on every device", throughput="grows with the devices",
               communication="all-reduce of all gradients each step"),
    "MP": dict(memory="the model divided by the devices", throughput="no faster than one device",
               communication="activations and their gradients at each boundary"),
    "PP": dict(memory="the model divided by the devices", throughput="close to p x when m >> p",
               communication="as MP, in micro-batches"),
}


@dataclass(frozen=True)
class CompareConfig:
    """The shared workload: one model, one batch shape, the same steps for every strategy."""

    model: str = "tiny"
    vocab_size: int = 2048
    train_examples: int = 512
    batch_size: int = 16          # sequences per step (the global batch for DP)
    max_length: int = 32          # every batch padded to it: equal shapes, comparable step times
    steps: int = 5
    warmup: int = 2               # first steps left out of tokens/s
    n_devices: int = 2
    micro_batches: int = 4        # PP
    lr: float = 1e-3
    seed: int = 0
    timeout: float = 300.0        # the DP launch


@dataclass(frozen=True)
class Measured:
    """One row of the comparison, all numbers from this machine."""

    strategy: str                 # "1 device", "DP", "MP" or "PP"
    devices: int
    tokens_per_sec: float         # target tokens per second, after warm-up
    state_bytes: float            # parameters + gradients + optimizer states, busiest device (measured)
    estimate_bytes: float         # training_memory(..., "fp32", "adamw").per_device(stages)
    comm_bytes: float             # sent per device per step, from the run's tensor sizes
    bubble: Optional[float]       # idle share of a recorded step (MP, PP)
    code: str                     # what ran


def _state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    return max(row.total for row in memory_report(module, optimizer).values())


def _handover_bytes(model: torch.nn.Module, boundary: float) -> float:
    """Most bytes one device sends per step under a device map: each hand-over forward, back in backward."""
    keys = [key for key, _, _ in placement(model)]
    sent: dict[object, float] = {}
    for a, b in zip(keys, keys[1:]):
        if a != b:  # forward: a sends the hidden states; backward: b sends their gradient
            sent[a] = sent.get(a, 0.0) + boundary
            sent[b] = sent.get(b, 0.0) + boundary
    return max(sent.values(), default=0.0)


def measure(config: CompareConfig = CompareConfig()) -> list[Measured]:
    """Run every strategy on the same workload; rows in the order 1 device, DP, MP, PP.

    Threads: one per rank (DP), per stage (PP) and for the single process, so that on a
    CPU every strategy runs on the cores it would own as devices (the caller's thread
    count is restored afterwards). Every strategy's steps are timed into a
    :class:`~parallel_lib.common.training.TrainRecord`, each clock read after its devices
    finished their queued work, and tokens/s is its throughput after ``config.warmup`` steps.

    Raises:
        ValueError: ``config.n_devices`` GPUs asked for on a machine with fewer (and some).
    """
    devices(config.n_devices)  # by the device rule: fail before any strategy has run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(config)
    finally:
        torch.set_num_threads(threads)


def _measure(config: CompareConfig) -> list[Measured]:
    pairs = load_corpus("train", size=config.train_examples)
    tokenizer = get_tokenizer(pairs, vocab_size=config.vocab_size)
    collate = partial(collate_batch, src_key="de", tgt_key="en", tokenizer=tokenizer,
                      model_max_length=config.max_length, pad_to_max_length=True)
    b = config.batch_size
    batches = [collate(pairs[k * b:(k + 1) * b]) for k in range(config.steps)]
    reference = build_gpt2(config.model, vocab_size=len(tokenizer), seed=config.seed)
    n, p = count_parameters(reference), config.n_devices
    estimate = training_memory(n, "fp32", "adamw")
    grad_bytes = sum(t.numel() * t.element_size() for t in reference.parameters())
    boundary = b * config.max_length * reference.config.n_embd * 4  # one batch's fp32 hidden states
    rows = []

    def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=config.lr)

    single = copy.deepcopy(reference)
    optimizer = adamw(single)
    record = train(single, optimizer, batches, progress=False)
    replica_bytes = _state_bytes(single, optimizer)
    rows.append(Measured("1 device", 1, record.throughput(skip=config.warmup), replica_bytes, estimate.total, 0.0,
                         None, "train()"))

    dp_run = RunConfig(data="corpus", model=config.model, batch_size=b, steps=config.steps,
                       train_examples=config.train_examples, vocab_size=config.vocab_size, seq_len=config.max_length,
                       lr=config.lr, seed=config.seed, return_state=False)
    results = train_layout(Plan(dp=p, sync="bucketed", micro_batches=1), dp_run, timeout=config.timeout)
    rows.append(Measured("DP", p, job_record(results).throughput(skip=config.warmup),
                         replica_bytes,  # every rank holds the replica measured above
                         estimate.total, ring_wire_bytes("all_reduce", grad_bytes, p), None,
                         f"train_layout(Plan(dp={p}, sync='bucketed')) (chapter 01)"))

    split = parallelize(copy.deepcopy(reference), get_device_map(reference.config.n_layer, list(range(p))))
    optimizer = adamw(split)
    first = resolve_device(0)
    record = train(split, optimizer, batches, progress=False, device=first)
    with record_timeline(split) as events:  # one more step, timed part by part
        forward_loss(split, {k: v.to(first) for k, v in batches[0].items()}).backward()
    rows.append(Measured("MP", p, record.throughput(skip=config.warmup), _state_bytes(split, optimizer),
                         estimate.per_device(p), _handover_bytes(split, boundary), idle_fraction(events),
                         f"parallelize() over {p} devices (chapter 03)"))

    stages = gpt2_stages(copy.deepcopy(reference), devices(p))
    optimizer = adamw(stages)
    record = TrainRecord()
    with Pipe(stages, stages.devices, chunks=config.micro_batches, schedule="1f1b") as pipe:
        clock = DeviceClock(pipe.devices)  # the stages' devices: a step ends when the last one is done
        for batch in batches:
            weights = batch["label_token_weights"]
            loss_fn = partial(weighted_cross_entropy, denominator=weights.sum())
            start = clock()
            optimizer.zero_grad(set_to_none=True)
            loss = pipe.train_step(batch["input_ids"], (batch["labels"], weights), loss_fn, reduction="sum")
            optimizer.step()
            end = clock()
            record.append(loss.item(), int(weights.sum().item()), end - start)
        bubble = idle_fraction(pipe.timeline.events)
        state = max(_state_bytes(part, optimizer) for part in pipe.partitions)
    rows.append(Measured("PP", p, record.throughput(skip=config.warmup), state, estimate.per_device(p),
                         boundary, bubble, f"Pipe(1F1B, m={config.micro_batches}) over {p} stages (chapter 04)"))
    return rows


def markdown_table(rows: list[Measured], machine: Optional[str] = None) -> str:
    """The comparison as Markdown, one row per strategy, with the rule of thumb from the planner."""
    base = rows[0].tokens_per_sec
    cells = [[r.strategy, r.devices, f"{r.state_bytes / 1e6:.2f} MB ({r.estimate_bytes / 1e6:.2f} MB)",
              f"{r.tokens_per_sec:,.0f} ({r.tokens_per_sec / base:.2f}×)", f"{r.comm_bytes / 1e6:.2f} MB",
              "—" if r.bubble is None else f"{r.bubble:.0%}", WHEN_TO_USE.get(r.strategy, "the reference: no parallelism")]
             for r in rows]
    header = ["strategy", "devices", "memory per device, measured (estimate)", "tokens/s (vs 1 device)",
              "sent per device per step", "bubble", "when to use"]
    return f"Measured on {machine or machine_label()}.\n\n" + tables.markdown_table(header, cells)
