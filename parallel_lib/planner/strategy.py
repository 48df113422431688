"""Choosing a strategy: which of DP, MP, PP and DP×PP fit, and what each costs.

Chapters 01–04 each measured one strategy. The planner puts their cost models side
by side for a model and a cluster the reader may not have, so the choice is
reasoned rather than guessed. It adds no formula of its own; it combines:

- memory: :func:`parallel_lib.model_parallel.memory.training_memory` (bytes per parameter, split
  evenly over a pipeline's stages) and :func:`~parallel_lib.model_parallel.memory.activation_memory`
  (what the busiest stage keeps for backward);
- idle time: :func:`parallel_lib.pipeline_parallel.schedule.bubble_fraction` (model parallelism
  is a pipeline with one micro-batch, so its bubble is ``(p - 1) / p``);
- communication: :func:`parallel_lib.cost.alpha_beta.allreduce_cost` for the gradients, plus the
  hidden states that cross each stage boundary forward and their gradients backward, each group
  priced on the link it crosses (:class:`~parallel_lib.planner.hardware.Links`): a replica's stages
  are consecutive ranks (the runtime's order, pipeline faster than data), so a pipeline of at most
  8 stages, and data parallelism over at most 8 GPUs in all, stay on one node's NVLink; wider, the
  ring runs at InfiniBand's speed.

Communication is in bytes each device *sends* per step (the busiest device);
``allreduce_cost(S, N, bandwidth=1, latency=0)`` is exactly that volume for a ring,
``2 (N - 1) / N * S``. Memory is in GiB (2**30 bytes), traffic in GB (10**9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.cost.alpha_beta import allreduce_cost
from parallel_lib.model_parallel.memory import (
    DTYPE_BYTES,
    MODEL_SHAPES,
    OPTIMIZER_STATES,
    GiB,
    ModelShape,
    activation_memory,
    training_memory,
)
from parallel_lib.pipeline_parallel.schedule import SCHEDULES, bubble_fraction
from parallel_lib.planner.hardware import Links
from parallel_lib.planner.option import PART_ONE, STRATEGIES, WHEN_TO_USE, Option, Plan, p2p_bytes, ring_bytes
from parallel_lib.planner.sharded_tensor import tensor_parallel_option, zero_option

__all__ = ["PART_ONE", "STRATEGIES", "WHEN_TO_USE", "Option", "Plan", "plan", "fewest_stages", "ring_bytes", "p2p_bytes"]

def fewest_stages(fits: Callable[[int, int], bool], n_gpus: int, n_layers: int, min_stages: int = 1,
                  min_replicas: int = 1) -> Optional[tuple[int, int]]:
    """``(stages, replicas)``: the fewest stages for which ``fits(stages, n_gpus // stages)``; None if none.

    Fewer stages mean a smaller bubble and fewer hand-overs; the GPUs left over go to more
    replicas, which also shrink each replica's share of the batch (so ``fits`` is asked with the
    replicas it would really have). A stage holds one block at least: at most ``n_layers`` stages.
    """
    for stages in range(min_stages, min(n_gpus, n_layers) + 1):
        replicas = n_gpus // stages
        if replicas < min_replicas:
            break
        if fits(stages, replicas):
            return stages, replicas
    return None


@dataclass(frozen=True)
class _Inputs:
    """What :func:`plan` was asked, checked; :meth:`cost` prices any layout of it."""

    shape: ModelShape
    seq_len: int
    batch_size: int
    gpu_bytes: float
    n_gpus: int
    dtype: str
    optimizer: Optional[str]
    schedule: str
    links: Links
    attention_scores: bool
    include_activations: bool
    accumulate: bool
    recompute: bool
    micro_batches: Optional[int]

    def cost(self, strategy: str, replicas: int, stages: int, micro_batches: int,
             notes: Sequence[str] = (), blocker: str = "", recompute: bool = False) -> Option:
        """The option for ``replicas`` x ``stages``; ``blocker`` (a reason) makes it infeasible.

        DP and MP run their micro-batches one after another (gradient accumulation): a device keeps
        one micro-batch's activations. A pipeline keeps all m (GPipe) or at most p (1F1B) of them.
        """
        s, width = self.shape, DTYPE_BYTES[self.dtype]
        memory = training_memory(s.n_params, self.dtype, self.optimizer)
        rows = math.ceil(self.batch_size / replicas)  # sequences of the busiest replica
        m = min(micro_batches, rows)  # a micro-batch holds one sequence at least
        sequential = strategy in ("DP", "MP")
        kept = 1 if sequential else (m if self.schedule == "gpipe" else min(stages, m))
        held = min(rows, math.ceil(rows / m) * kept)
        layers = math.ceil(s.n_layers / stages)  # the busiest stage's blocks
        acts = 0.0
        if self.include_activations:  # 16-bit values in activation_memory: scaled as memory.model_memory does
            acts = activation_memory(held, self.seq_len, s.hidden, s.n_heads, layers, self.attention_scores,
                                     recompute) * width / 2
        state, grads = memory.per_device(stages), memory.gradients / stages
        allreduce = ring_bytes(grads, replicas)
        p2p = p2p_bytes(rows * self.seq_len * s.hidden * width, stages)
        # a replica's stages are consecutive ranks: the pipeline spans `stages`, the replicas all the GPUs used
        dp_span, pp_span = replicas * stages, stages
        seconds = allreduce_cost(grads, replicas, self.links.bandwidth(dp_span), 0.0) + \
            p2p / self.links.bandwidth(pp_span)
        bubble = bubble_fraction(stages, 1 if strategy == "MP" else m)
        fits = state + acts <= self.gpu_bytes
        why = [blocker] if blocker else []
        why.append(f"{state / GiB:.1f} GiB of training state ({memory.total / s.n_params:g} bytes/parameter x "
                   f"{s.n_params / 1e9:.2f} B parameters / {stages} stage(s)) + {acts / GiB:.1f} GiB of activations "
                   f"({held} sequence(s) x {layers} block(s){', recomputed' if recompute else ''}) = "
                   f"{(state + acts) / GiB:.1f} GiB {'<=' if fits else '>'} {self.gpu_bytes / GiB:g} GiB per GPU")
        if sequential and m > 1:
            why.append(f"gradient accumulation: {m} micro-batches of at most {math.ceil(rows / m)} sequence(s), "
                       "one after another, one optimizer step")
        if recompute:
            why.append("activation recomputation: each block keeps only its input and runs its forward again "
                       "in backward (4 instead of 3 units of compute: x 3/4 useful)")
        why += notes
        if stages > 1:
            why.append(f"bubble (p-1)/(m+p-1) = ({stages}-1)/({1 if strategy == 'MP' else m}+{stages}-1) = "
                       f"{bubble:.0%}; the busiest stage sends {p2p / 1e9:.3f} GB of hidden states and their "
                       "gradients per step")
        if replicas > 1:
            why.append(f"ring all-reduce of {grads / 1e9:.3f} GB of gradients over {replicas} replicas: "
                       f"2(N-1)/N x S = {allreduce / 1e9:.3f} GB sent per GPU per step")
        over = ([f"gradients on {self.links.describe(dp_span)}"] if replicas > 1 else []) + \
            ([f"hidden states on {self.links.describe(pp_span)}"] if stages > 1 else [])
        why.append(f"communication {seconds * 1e3:.1f} ms per step" + (f" ({'; '.join(over)})" if over else ""))
        return Option(strategy, replicas, stages, m, state, acts, bubble, allreduce, p2p, seconds,
                      fits and not blocker, tuple(why), recompute)

    def pipeline_micro_batches(self, stages: int) -> int:
        return self.micro_batches or 4 * stages

    def fit(self, strategy: str, replicas: int, stages: int, notes: Sequence[str] = (), blocker: str = "",
            recompute: bool = False) -> Option:
        """The cheapest way ``strategy`` runs on ``replicas`` x ``stages``, or its plain (infeasible) option.

        A pipeline runs its ``micro_batches`` (default 4p); DP and MP start with one micro-batch and,
        if ``accumulate``, split it into the fewest micro-batches whose activations fit.
        """
        sequential = strategy in ("DP", "MP")
        first = (self.micro_batches or 1) if sequential else self.pipeline_micro_batches(stages)
        option = self.cost(strategy, replicas, stages, first, notes, blocker, recompute)
        if option.feasible or blocker or not (sequential and self.accumulate):
            return option
        rows = math.ceil(self.batch_size / replicas)
        for per_micro_batch in range(math.ceil(rows / option.micro_batches) - 1, 0, -1):  # fewest steps first
            accumulated = self.cost(strategy, replicas, stages, math.ceil(rows / per_micro_batch), notes, blocker,
                                    recompute)
            if accumulated.feasible:
                return accumulated
        return option

    def fits(self, stages: int, replicas: int, recompute: bool = False) -> Optional[Option]:
        """The feasible option of ``replicas`` copies of a ``stages``-stage split, or None."""
        strategy = "DP" if stages == 1 else ("PP" if replicas == 1 else "DP×PP")
        option = self.fit(strategy, replicas, stages, recompute=recompute)
        return option if option.feasible else None

    def search(self, min_stages: int, min_replicas: int) -> Optional[Option]:
        """:func:`fewest_stages` under this plan's memory test; recomputation only if nothing fits without."""
        for recompute in (False, True) if self.recompute else (False,):
            found = fewest_stages(lambda stages, replicas: self.fits(stages, replicas, recompute) is not None,
                                  self.n_gpus, self.shape.n_layers, min_stages, min_replicas)
            if found is not None:
                return self.fits(*found, recompute)
        return None

    def options(self) -> tuple[Option, ...]:
        n, split = self.n_gpus, min(self.n_gpus, self.shape.n_layers)

        def fit(strategy: str, replicas: int, stages: int, notes: Sequence[str] = (), blocker: str = "") -> Option:
            option = self.fit(strategy, replicas, stages, notes, blocker)
            if option.feasible or blocker or not self.recompute:
                return option
            recomputed = self.fit(strategy, replicas, stages, notes, blocker, recompute=True)
            return recomputed if recomputed.feasible else option

        idle = [f"the batch of {self.batch_size} sequences feeds only {self.batch_size} of {n} GPUs"
                if self.batch_size < n else "no bubble: every GPU computes the whole step"]
        dp = fit("DP", min(n, self.batch_size), 1, idle)
        short = []
        if split < n:
            short.append(f"{self.shape.n_layers} blocks make at most {split} stages: {n - split} GPU(s) idle")
        cannot = "one GPU cannot be split into stages" if split < 2 else ""
        mp = fit("MP", 1, split, short + ["one stage computes at a time"], cannot)
        pp = fit("PP", 1, split, short, cannot)
        hybrid = self.search(2, 2)  # the fewest stages that hold a replica, replicated n // stages times
        if hybrid is not None:
            note = f"{hybrid.stages} stages are the fewest that hold a replica; {n} GPUs hold {hybrid.replicas}"
            return dp, mp, pp, replace(hybrid, reasons=hybrid.reasons + (note,))
        blocker = f"fewer than 2 replicas of a pipeline that fits find room on {n} GPU(s)"
        return dp, mp, pp, self.cost("DP×PP", 1, max(split, 1), self.pipeline_micro_batches(split), (), blocker)


def plan(model: Union[str, ModelShape], seq_len: int, batch_size: int, gpu_gib: float, n_gpus: int,
         dtype: str = "fp16", optimizer: Optional[str] = "adamw", schedule: str = "1f1b",
         micro_batches: Optional[int] = None, links: Union[str, Links] = "H100", attention_scores: bool = False,
         include_activations: bool = True, accumulate: bool = True, recompute: bool = True,
         strategies: Sequence[str] = PART_ONE) -> Plan:
    """Cost every strategy for training ``model`` on ``n_gpus`` GPUs of ``gpu_gib`` GiB.

    Layouts: DP runs one replica per GPU (at most one per sequence); MP and PP split
    the model over all GPUs (at least one block per stage), MP one micro-batch at a time
    (chapter 03), PP with ``micro_batches``; DP×PP splits each replica over the fewest
    stages (at least 2) that hold it and runs ``n_gpus // stages`` such pipelines.

    When a layout does not fit, DP and MP first accumulate gradients over the fewest
    micro-batches whose activations fit (same step, same result, smaller matrices), then
    any layout tries activation recomputation (a quarter of the compute lost). DP×PP uses
    recomputation only when no stage count fits without it.

    Args:
        model: a name from :data:`parallel_lib.model_parallel.memory.MODEL_SHAPES` or a ``ModelShape``.
        seq_len: tokens per sequence.
        batch_size: sequences per step, the global batch.
        gpu_gib: memory of one GPU in GiB.
        n_gpus: GPUs available.
        dtype: "fp16"/"bf16" (mixed precision) or "fp32".
        optimizer: "adamw", "adam", "sgd_momentum", "sgd", or None (inference).
        schedule: "1f1b" (a stage keeps at most p micro-batches) or "gpipe" (all m).
        micro_batches: per replica and step; default ``4 p`` (the GPipe paper: with
            m >= 4p the bubble is negligible), at most one per sequence.
        links: the cluster's links, for the communication time: a GPU name of
            :data:`~parallel_lib.planner.hardware.GPUS` (its DGX node: 8 GPUs on NVLink, InfiniBand
            between nodes; "H100": 450 and 50 GB/s per GPU and direction) or a
            :class:`~parallel_lib.planner.hardware.Links`. Each group is priced on the link it crosses.
        attention_scores: count stored attention score matrices (no FlashAttention).
        include_activations: False: training state only, as ``training_memory(...).min_devices``.
        accumulate: let DP and MP split their batch into micro-batches (gradient accumulation).
        recompute: allow activation recomputation where nothing fits without it.
        strategies: which of :data:`STRATEGIES` to price; by default Part I's four. Add "ZeRO" and
            "TP×DP" (or pass ``STRATEGIES``) for sharded data parallelism and tensor parallelism.

    Raises:
        ValueError: an unknown model, dtype, optimizer, schedule or GPU name for ``links``, a size that
            is not positive and finite, or a ``gpu_gib`` so large that it must be bytes.
        TypeError: ``model`` is neither a name nor a ``ModelShape``; ``links`` neither a name nor ``Links``.
    """
    if isinstance(model, ModelShape):
        name, shape = f"{model.n_params / 1e9:.2f} B parameters", model
    elif isinstance(model, str) and model in MODEL_SHAPES:
        name, shape = model, MODEL_SHAPES[model]
    elif isinstance(model, str):
        raise ValueError(f"model must be one of {sorted(MODEL_SHAPES)} or a ModelShape, got model={model!r}")
    else:
        raise TypeError(f"model must be a name or a ModelShape, got {type(model).__name__}")
    for arg, value in (("seq_len", seq_len), ("batch_size", batch_size), ("n_gpus", n_gpus)):
        positive_int(arg, value)
    if micro_batches is not None:
        positive_int("micro_batches", micro_batches)
    if isinstance(links, str):
        links = Links.of(links)
    elif not isinstance(links, Links):
        raise TypeError(f"links must be a GPU name such as 'H100' or a planner.hardware.Links, got "
                        f"{type(links).__name__}")
    if positive_number("gpu_gib", gpu_gib) > 2**20:  # a mebi-GiB GPU (a pebibyte) is bytes given for GiB
        raise ValueError(f"gpu_gib is in GiB, got gpu_gib={gpu_gib!r}, which looks like bytes; "
                         f"pass {gpu_gib!r} / GiB (= {gpu_gib / GiB:g})")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got dtype={dtype!r}")
    if optimizer is not None and optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)} or None, got optimizer={optimizer!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got schedule={schedule!r}")
    if isinstance(strategies, str) or not strategies or set(strategies) - set(STRATEGIES):
        raise ValueError(f"strategies must be a non-empty list from {STRATEGIES}, got strategies={strategies!r}")
    inputs = _Inputs(shape, seq_len, batch_size, gpu_gib * GiB, n_gpus, dtype, optimizer, schedule, links,
                     attention_scores, include_activations, bool(accumulate), bool(recompute), micro_batches)
    options = [o for o in inputs.options() if o.strategy in strategies]
    priced = dict(shape=shape, seq_len=seq_len, batch_size=batch_size, gpu_bytes=gpu_gib * GiB, n_gpus=n_gpus,
                  dtype=dtype, optimizer=optimizer, links=links, attention_scores=attention_scores,
                  include_activations=include_activations, recompute=bool(recompute))
    if "ZeRO" in strategies:
        options.append(zero_option(**priced))
    if "TP×DP" in strategies:
        options.append(tensor_parallel_option(**priced))
    return Plan(name, shape.n_params, seq_len, batch_size, gpu_gib * GiB, n_gpus, links, tuple(options), inputs)
