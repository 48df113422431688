"""Part II in the planner: sharded data parallelism (ZeRO) and tensor parallelism as options.

Chapters 06 and 07 each verified a formula against what their code holds and sends: ZeRO's
model-state bytes per rank and traffic (:func:`parallel_lib.cost.zero.zero_memory`,
:func:`~parallel_lib.cost.zero.zero_traffic`) and tensor parallelism's activation bytes and
collectives (:mod:`parallel_lib.tensor_parallel.cost`). The planner prices the two strategies with
those very functions, so what it predicts is what the chapters measured:

- **ZeRO**: one replica per GPU as in DP, with the lowest stage (1, 2 or 3) whose sharded state
  and one micro-batch's activations fit (gradient accumulation runs the rest of the batch);
- **TP** (× DP over the GPUs left): the smallest tensor-parallel degree that fits, with sequence
  parallelism, and never beyond one node — its four all-reduces per block and step need
  NVLink-class links (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", sec. 3.2, takeaway #1, p. 5: tensor parallelism within a node).
"""

from __future__ import annotations

import math
from typing import Optional

from parallel_lib.common.checks import positive_int
from parallel_lib.cost.alpha_beta import allreduce_cost
from parallel_lib.model_parallel.memory import (DTYPE_BYTES, OPTIMIZER_STATES, GiB, ModelShape, activation_memory,
                                                training_memory)
from parallel_lib.planner.hardware import Links
from parallel_lib.planner.option import Option, ring_bytes
from parallel_lib.cost.zero import zero3_working_set, zero_memory, zero_passes, zero_traffic
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import activation_bytes

__all__ = ["zero_option", "tensor_parallel_option", "GPUS_PER_NODE"]

GPUS_PER_NODE = 8  # a DGX/HGX node: the reach of NVLink (Links' default)


def _state_bytes_per_parameter(dtype: str, optimizer: Optional[str]) -> tuple[str, float]:
    """ZeRO's precision name and its K (optimizer bytes per parameter, master copy included)."""
    mixed = DTYPE_BYTES[dtype] < 4
    states = 4 * OPTIMIZER_STATES[optimizer] if optimizer else 0
    return ("bf16" if mixed else "fp32"), states + (4 if mixed else 0)


def _one_sequence(shape: ModelShape, seq_len: int, dtype: str, attention_scores: bool, recompute: bool,
                  include: bool) -> float:
    """Activation bytes of one sequence (16-bit formula scaled to ``dtype``), or 0 when not counted."""
    if not include:
        return 0.0
    return activation_memory(1, seq_len, shape.hidden, shape.n_heads, shape.n_layers, attention_scores,
                             recompute) * DTYPE_BYTES[dtype] / 2


def _working_set(shape: ModelShape, width: int) -> float:
    """ZeRO-3's gathered working set of a published shape: blocks of 12h² + 13h, the rest outside them."""
    block = 12 * shape.hidden ** 2 + 13 * shape.hidden
    outer = max(0, shape.n_params - shape.n_layers * block)
    return zero3_working_set([block] * shape.n_layers, outer, True, width, width)["total"]


def zero_option(shape: ModelShape, seq_len: int, batch_size: int, gpu_bytes: float, n_gpus: int,
                dtype: str = "fp16", optimizer: Optional[str] = "adamw", links: Optional[Links] = None,
                attention_scores: bool = False, include_activations: bool = True, recompute: bool = True) -> Option:
    """ZeRO over ``n_gpus`` replicas: the lowest stage whose model state and one micro-batch fit.

    Activations are one sequence's (gradient accumulation over the replica's share of the batch);
    where no stage fits, activation recomputation is tried (if ``recompute``) as the last resort.
    Traffic is :func:`~parallel_lib.cost.zero.zero_traffic` with one micro-batch per sequence: stage 1
    sends what DP sends, stage 2 ``(m + 1)/2`` times as much (a reduce-scatter per micro-batch), stage 3
    ``3m/2`` times (the parameters gathered twice per micro-batch). Its time is the ring's on the link
    the replicas' group crosses (``links``, default an H100 node's: NVLink within 8 GPUs, InfiniBand beyond).
    """
    links = links or Links.of("H100")
    replicas = min(n_gpus, batch_size)
    if optimizer is None or replicas < 2:
        why = ("inference keeps no gradients or optimizer states: nothing for ZeRO to shard" if optimizer is None
               else "one replica: no data-parallel ranks to shard the state over")
        return Option("ZeRO", replicas, 1, 1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False, (why,))
    precision, k = _state_bytes_per_parameter(dtype, optimizer)
    rows = math.ceil(batch_size / replicas)
    reasons = []
    for recomputed in (False, True) if recompute else (False,):
        acts = _one_sequence(shape, seq_len, dtype, attention_scores, recomputed, include_activations)
        for stage in (1, 2, 3):
            state = zero_memory(shape.n_params, replicas, stage, precision, optimizer_bytes=k)["total"]
            if stage == 3:  # the gathered embeddings and head, a block and the prefetched next one, and gradients
                state += _working_set(shape, DTYPE_BYTES[dtype])
            fits = state + acts <= gpu_bytes
            reasons.append(f"ZeRO-{stage}{' with recomputation' if recomputed else ''}: {state / GiB:.1f} GiB of "
                           f"sharded state over {replicas} ranks + {acts / GiB:.1f} GiB of one sequence's "
                           f"activations {'<=' if fits else '>'} {gpu_bytes / GiB:g} GiB")
            if fits:
                break
        if fits:
            break
    sent = zero_traffic(shape.n_params, replicas, stage, precision, micro_batches=rows)
    passes = zero_passes(stage, rows)
    per_sequence = {2: " (a reduce-scatter of the gradients per sequence)",
                    3: " (the parameters gathered twice and the gradients reduce-scattered per sequence)"}
    reasons.append(f"{rows} sequence(s) per rank, one at a time (gradient accumulation): stage {stage} sends "
                   f"{sent / 1e9:.3f} GB per GPU per step, {passes / 2:g}x data parallelism"
                   + (per_sequence.get(stage, "") if rows > 1 else ""))
    return Option(f"ZeRO-{stage}" if fits else "ZeRO", replicas, 1, rows, state, acts, 0.0, sent, 0.0,
                  sent / links.bandwidth(replicas), fits, tuple(reasons), recomputed)


def tensor_parallel_option(shape: ModelShape, seq_len: int, batch_size: int, gpu_bytes: float, n_gpus: int,
                           dtype: str = "fp16", optimizer: Optional[str] = "adamw", links: Optional[Links] = None,
                           attention_scores: bool = False, include_activations: bool = True,
                           recompute: bool = True, gpus_per_node: Optional[int] = None) -> Option:
    """The smallest tensor-parallel degree t (dividing the heads, within a node) that fits, × DP over the rest.

    Each GPU holds 1/t of the training state (the split matrices dominate; layer norms are
    negligible) and, with sequence parallelism, 1/t of one sequence's activations
    (Korthikanti et al. 2022). Per block and step: two all-reduces of ``s·h`` activations forward
    and two backward (with recomputation two more, the recomputed forward's), ``2(t-1)/t`` of each
    sent by every GPU, on NVLink (the group is one node's); then the DP all-reduce of its gradients, on
    NVLink while the whole job is one node, else on the network (``links``, default an H100 node's).
    ``gpus_per_node`` (default the links') bounds t.
    """
    links = links or Links.of("H100")
    gpus_per_node = links.gpus_per_node if gpus_per_node is None else positive_int("gpus_per_node", gpus_per_node)
    width = DTYPE_BYTES[dtype]
    memory = training_memory(shape.n_params, dtype, optimizer)
    degrees = [t for t in range(2, min(n_gpus, gpus_per_node) + 1) if shape.n_heads % t == 0 and n_gpus % t == 0]
    if not degrees:
        return Option("TP×DP", 1, 1, 1, memory.total, 0.0, 0.0, 0.0, 0.0, 0.0, False,
                      (f"no degree 2..{min(n_gpus, gpus_per_node)} divides both the {shape.n_heads} heads and "
                       f"the {n_gpus} GPU(s)",))
    gpt = GPTShape(shape.n_layers, shape.hidden, shape.n_heads, 1, seq_len)
    fits = False
    for recomputed in (False, True) if recompute else (False,):
        for t in degrees:
            state = memory.total / t
            if not include_activations:
                acts = 0.0
            elif recomputed:  # each block keeps its input, split by sequence parallelism; one block in full
                acts = _one_sequence(shape, seq_len, dtype, attention_scores, True, True) / t
            else:  # the formula counts 16-bit values
                acts = activation_bytes(1, seq_len, gpt, t, sequence_parallel=True,
                                        attention_scores=attention_scores) * width / 2
            fits = state + acts <= gpu_bytes
            if fits:
                break
        if fits:
            break
    replicas = n_gpus // t
    rows = math.ceil(batch_size / replicas)
    per_allreduce = rows * seq_len * shape.hidden * width
    per_block = 6 if recomputed else 4  # the recomputed forward's two all-reduces again (step_collectives)
    tp_sent = shape.n_layers * per_block * ring_bytes(per_allreduce, t)
    grads = memory.gradients / t
    dp_sent = ring_bytes(grads, replicas)
    # tp fastest: a tp group is t consecutive ranks (one node), the replicas' group spans all n_gpus
    seconds = tp_sent / links.bandwidth(t) + allreduce_cost(grads, replicas, links.bandwidth(n_gpus), 0.0)
    reasons = (f"t = {t} (the smallest degree that fits, dividing the {shape.n_heads} heads, at most "
               f"{gpus_per_node} GPUs of one node): {state / GiB:.1f} GiB of state + {acts / GiB:.2f} GiB of one "
               f"sequence's activations with sequence parallelism{' and recomputation' if recomputed else ''} "
               f"{'<=' if fits else '>'} {gpu_bytes / GiB:g} GiB",
               f"{per_block} all-reduces of {per_allreduce / 1e9:.4f} GB per block and step, "
               f"{tp_sent / 1e9:.3f} GB sent per GPU: inside a node only (NVLink)",
               f"{replicas} tensor-parallel group(s) as data-parallel replicas: {dp_sent / 1e9:.3f} GB of gradients "
               "sent per GPU")
    return Option("TP×DP", replicas, t, rows, state, acts, 0.0, dp_sent, tp_sent, seconds, fits, reasons,
                  recomputed)
