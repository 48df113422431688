"""What tensor parallelism costs: collectives per step, bytes per device, and an α–β time model.

The formulas here are checked against what the code does: :func:`step_collectives`
against :func:`parallel_lib.runtime.count_collectives` on every rank,
:func:`shard_parameters` against the shard's parameters. The time model is the course's
α–β model (:func:`parallel_lib.cost.alpha_beta.allreduce_cost`): each collective costs
a latency per ring step plus its bytes over the bandwidth, and the compute divides by t.

Per block and pass, with (b, s, h) activations of ``e`` bytes per element:

- tensor parallel: forward 2 all-reduces of ``b·s·h`` (the two ``g``), backward 2 (the two ``f``);
- sequence parallel: forward 2 all-gathers + 2 reduce-scatters of the same ``b·s·h``, backward
  the same plus 2 all-gathers: the column-parallel layers keep only their slice of the input and
  gather it again for the weights' gradients (Megatron-LM's way; the activations' formula,
  :func:`activation_bytes`, counts that slice, and the saved-tensor census agrees).
"""

from __future__ import annotations

from typing import Optional

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.cost.activation import activation_bytes  # the one activation formula (layer 0)
from parallel_lib.cost.alpha_beta import allreduce_cost
from parallel_lib.cost.alpha_beta import wire_bytes
from parallel_lib.cost.shape import GPTShape

__all__ = ["layer_collectives", "step_collectives", "wire_bytes", "shard_parameters",
           "activation_bytes", "training_flops", "collective_seconds", "step_seconds", "crossover_width",
           "NVLINK_H100"]

Collectives = dict[str, tuple[int, int]]  # kind -> (calls, message bytes), as CollectiveCounter.by_kind()

# NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both directions together, so 450 GB/s per direction);
# latency of a few microseconds per NCCL ring step (nccl-tests small-message times). A prediction, not measured.
NVLINK_H100 = dict(bandwidth=450e9, latency=5e-6)


def _add(total: Collectives, kind: str, calls: int, nbytes: int) -> None:
    if calls:
        old = total.get(kind, (0, 0))
        total[kind] = (old[0] + calls, old[1] + nbytes)


def layer_collectives(batch: int, seq: int, hidden: int, sequence_parallel: bool = False,
                      bytes_per_element: int = 4) -> dict[str, Collectives]:
    """One block's collectives: ``{"forward": {...}, "backward": {...}}`` (two ``g`` / two ``f``).

    Under sequence parallelism backward also gathers the two column-parallel layers' inputs again
    (:func:`~parallel_lib.tensor_parallel.regions.sequence_parallel_linear`).
    """
    size = batch * seq * hidden * bytes_per_element
    if sequence_parallel:  # backward: the two column-parallel inputs gathered again (their slices were kept)
        return {"forward": {"all_gather": (2, 2 * size), "reduce_scatter": (2, 2 * size)},
                "backward": {"all_gather": (4, 4 * size), "reduce_scatter": (2, 2 * size)}}
    return {"forward": {"all_reduce": (2, 2 * size)}, "backward": {"all_reduce": (2, 2 * size)}}


def step_collectives(shape: GPTShape, batch: int, seq: int, tp: int, sequence_parallel: bool = False,
                     bytes_per_element: int = 4, recompute: bool = False) -> Collectives:
    """A training step's collectives on one rank of a tensor-parallel GPT-2 (no data parallelism).

    Blocks (:func:`layer_collectives`), plus the vocabulary-parallel embedding (one ``g``
    forward, or a reduce-scatter; under SP its backward all-gathers), the tied head's
    input (``f`` backward, or an all-gather forward and reduce-scatter backward), the
    loss's three all-reduces of ``b·s`` values (max, target logit, sum of exp), and under
    SP one all-reduce of the gradients of the sequence-parallel parameters.

    ``recompute``: full activation recomputation of every block (each keeps only its input and runs
    its forward again in backward, ``torch.utils.checkpoint``): the recomputed forward issues the
    blocks' forward collectives once more, 2 all-reduces per block (or, under SP, 2 all-gathers and
    2 reduce-scatters), so a block's step has 6 all-reduces instead of 4, as under Megatron's full
    recomputation. The embedding, the head and the loss are not recomputed.
    """
    for name, value in dict(batch=batch, seq=seq, tp=tp).items():
        positive_int(name, value)
    if tp == 1:
        return {}
    size, e = batch * seq * shape.n_embd * bytes_per_element, bytes_per_element
    total: Collectives = {}
    per_layer = layer_collectives(batch, seq, shape.n_embd, sequence_parallel, bytes_per_element)
    for phase in ("forward", "backward") + (("forward",) if recompute else ()):
        for kind, (calls, nbytes) in per_layer[phase].items():
            _add(total, kind, shape.n_layer * calls, shape.n_layer * nbytes)
    if sequence_parallel:
        _add(total, "reduce_scatter", 2, 2 * size)  # embedding forward, head input backward
        _add(total, "all_gather", 2, 2 * size)      # head input forward, embedding backward
    else:
        _add(total, "all_reduce", 2, 2 * size)      # embedding forward (g), head input backward (f)
    _add(total, "all_reduce", 3, 3 * batch * seq * 4)  # the loss: max, target logit, sum of exp (fp32)
    if sequence_parallel:  # what each rank holds whole and sees only its tokens' share of: the gradients' sum
        h, norm = shape.n_embd, (1 if shape.rms_norm else 2)  # RMSNorm: a weight; LayerNorm: weight and bias
        per_block = 2 * norm * h + (2 * h if shape.bias else 0)  # two norms, two row-parallel biases (GPT-2)
        whole = shape.n_layer * per_block + norm * h + (shape.n_positions * h if shape.learned_positions else 0)
        _add(total, "all_reduce", 1, whole * e)
    return total


def shard_parameters(shape: GPTShape, tp: int) -> int:
    """Parameters one rank holds: split matrices and column biases /t, norms, row biases and positions whole.

    GPT-2: ``L · ((12h² + 7h)/t + 6h) + V·h/t + n_positions·h + 2h``; a Llama shape adds its untied head
    and counts SwiGLU, grouped-query attention and RMSNorm (:meth:`GPTShape.block_parameters`).

    Raises:
        ValueError: ``tp`` does not divide the heads, the key/value heads or the vocabulary.
    """
    return shape.parameters(tp)


def training_flops(shape: GPTShape, batch: int, seq: int) -> float:
    """FLOPs of one training step: ``72·b·s·L·h²·(1 + s/(6h) + V/(12·h·L))`` (Narayanan et al. 2021, eq. 3).

    That is ``6·b·s·(L·P + V·h) + 12·b·s²·L·h`` with ``P = 12h²`` a GPT block's matrices; a Llama
    shape uses its own ``P`` (:meth:`GPTShape.matmul_parameters`: SwiGLU and grouped-query attention).
    """
    b, s, L, h, V = batch, seq, shape.n_layer, shape.n_embd, shape.vocab_size
    return 6 * b * s * (L * shape.matmul_parameters() + V * h) + 12 * b * s * s * L * h


def collective_seconds(collectives: Collectives, tp: int, bandwidth: float, latency: float) -> float:
    """α–β time of ``collectives``: an all-reduce is a reduce-scatter plus an all-gather (2(t-1) ring steps)."""
    positive_int("tp", tp)
    seconds = 0.0
    for kind, (calls, nbytes) in collectives.items():
        full = allreduce_cost(nbytes, tp, bandwidth, 0.0) + calls * 2 * (tp - 1) * latency
        seconds += full if kind == "all_reduce" else full / 2
    return seconds


def step_seconds(shape: GPTShape, batch: int, seq: int, tp: int, flops_per_second: float, bandwidth: float,
                 latency: float, sequence_parallel: bool = False) -> dict[str, float]:
    """Predicted step time: compute ``training_flops / (t · rate)`` plus the step's collectives."""
    check_number("flops_per_second", flops_per_second, 0.0, strict=True)
    compute = training_flops(shape, batch, seq) / (tp * flops_per_second)
    comm = collective_seconds(step_collectives(shape, batch, seq, tp, sequence_parallel), tp, bandwidth, latency)
    return dict(compute=compute, communication=comm, total=compute + comm)


def crossover_width(shape: GPTShape, batch: int, seq: int, flops_per_second: float, bandwidth: float,
                    latency: float, tp: int = 2, widths: Optional[list[int]] = None) -> Optional[int]:
    """The smallest width (a multiple of 64·tp, heads of 64) at which tp ranks beat one, or None up to 8192."""
    for h in widths or list(range(64 * tp, 8193, 64 * tp)):
        wide = GPTShape(shape.n_layer, h, max(tp, h // 64), shape.vocab_size, shape.n_positions)
        one = step_seconds(wide, batch, seq, 1, flops_per_second, bandwidth, latency)["total"]
        many = step_seconds(wide, batch, seq, tp, flops_per_second, bandwidth, latency)["total"]
        if many < one:
            return h
    return None
