"""What one rank of a DP × TP × PP plan holds and sends per step: the formulas the counter is checked against.

Rank ``(d, j, t)`` of :func:`~parallel_lib.training.run.train` holds slice t of stage j. Per
step, with ``m`` micro-batches of ``b`` rows, sequence ``s``, width ``h``, 4-byte floats:

- **tp** (its stage's tensor-parallel group, when tp > 1): chapter 07's collectives, per
  micro-batch, for its own blocks only (:func:`~parallel_lib.tensor_parallel.cost.layer_collectives`:
  2 all-reduces of ``b·s·h`` forward, 2 backward), plus the embedding's forward ``g`` on
  the first stage and the head's backward ``f`` and the loss's 3 all-reduces of ``b·s``
  values on the last. With recomputation the forward runs twice, its all-reduces too.
  Summed over the stages this is :func:`~parallel_lib.tensor_parallel.cost.step_collectives`
  per micro-batch: splitting the layers over stages moves no collective. (Without sequence
  parallelism: these formulas do not cover it.)
- **pp** (send/recv with the same slice of the neighbouring stages): one boundary's
  activations ``b·s·h`` per micro-batch forward (not from the last stage) and its gradient
  backward (not from the first): ``p2p_bytes`` of the planner, per micro-batch.
- **dp** (the same slice of the same stage in every replica, when dp > 1): chapter 06's
  :class:`~parallel_lib.sharding.zero.ZeroEngine` over the stage's parameters. It never sends a
  parameter alone: it packs them into flat groups (:func:`dp_groups`), each padded to a multiple
  of dp (:func:`~parallel_lib.sharding.flat.padded_numel`), and the padding travels too:

      groups   the tied embedding's copy alone (first and last stage, pp > 1), so that its
               shard is the same slice on both ends; the rest in buckets of at most 25 MiB,
               filled in reverse order (stages 0-2), or one group per block plus one of
               what is outside the blocks (stage 3)
      zero 0   one all-reduce per group of its padded size ``P``: ``2(dp-1)/dp · ΣP`` on the wire
      zero 1   one reduce-scatter per group after backward and one all-gather after the
               step: ``(dp-1)/dp · ΣP`` each, the same wire bytes as zero 0
      zero 2   the reduce-scatter runs from backward hooks, once per micro-batch's backward
               (``m`` per group), then one all-gather per group
      zero 3   per micro-batch, every group all-gathered before its forward and again before
               its backward (freed in between), and reduce-scattered after it: ``2m``
               all-gathers and ``m`` reduce-scatters per group, nothing after the step

  These are :func:`~parallel_lib.cost.zero.zero_collectives` of the padded groups, and the wire
  bytes :func:`~parallel_lib.cost.zero.zero_traffic` of ``ΣP`` values with ``m`` micro-batches.
  (Under recomputation ZeRO-3's hooks fire on the second forward too: not in this formula.)
- **tied** (first and last stage of the same slice, when pp > 1): one all-reduce of this
  rank's part of the reduced gradient of the embedding's vocabulary slice, ``V/t · h`` padded
  to a multiple of dp: all of it at zero 0, its 1/dp shard at zero 1-3.

The model state (:func:`state_bytes`) is the tensor census ``train`` takes between backward and
step (:func:`~parallel_lib.sharding.memory.engine_census`): the ZeRO paper's
:func:`~parallel_lib.sharding.memory.zero_memory` of ``ΣP`` values in fp32 (parameters 4,
gradients 4, AdamW's two moments 8 bytes each, sharded by stage), plus torch AdamW's step count,
one 4-byte tensor per flat group. It holds at every ZeRO stage 0-3 (``tests/test_training_3d.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from parallel_lib.common.checks import check_choice, positive_int
from parallel_lib.cost.zero import zero_collectives
from parallel_lib.cost.alpha_beta import wire_bytes
from parallel_lib.data_parallel.buckets import make_buckets
from parallel_lib.sharding.flat import padded_numel
from parallel_lib.sharding.memory import zero_memory
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import layer_collectives, shard_parameters

__all__ = ["stage_parameters", "stage_tensor_sizes", "dp_groups", "owned_parameters", "expected_traffic",
           "wire_bytes", "state_bytes", "group_sizes", "FLOAT", "BUCKET_CAP_MB"]

FLOAT = 4  # bytes per element: the runs train in float32
BUCKET_CAP_MB = 25.0  # ZeroEngine's default bucket, in 2**20 bytes (train() keeps it)
Traffic = dict[str, dict[str, tuple[int, int]]]  # group kind -> {collective: (calls, message bytes)}


def _block_sizes(h: int, tp: int) -> list[int]:
    """One block's parameter tensors in module order: ln_1, c_attn, attn's c_proj, ln_2, c_fc, mlp's c_proj
    (weight then bias; column layers and their biases split by ``tp``, row layers' biases and norms whole)."""
    return [h, h, 3 * h * h // tp, 3 * h // tp, h * h // tp, h, h, h, 4 * h * h // tp, 4 * h // tp, 4 * h * h // tp, h]


def stage_tensor_sizes(shape: GPTShape, tp: int, blocks: int, first: bool, last: bool, pp: int
                       ) -> tuple[list[list[int]], list[int], list[int]]:
    """A stage's parameter tensors (elements each), in the stage module's order.

    Returns:
        ``(per block, outside the blocks, tied)``: the blocks' tensors, then ``wpe`` (first stage),
        ``ln_f`` (last) and, with one stage, ``wte`` (which is the head); ``tied`` holds the
        embedding slice ``V/t · h`` that the first or last stage keeps as a copy when ``pp > 1``.
    """
    h, vocab = shape.n_embd, shape.vocab_size * shape.n_embd // tp
    outer, tied = [], []
    if first:
        (tied if pp > 1 else outer).append(vocab)
        outer.append(shape.n_positions * h)
    if last:
        outer += [h, h]
        if pp > 1:
            tied.append(vocab)
    return [_block_sizes(h, tp) for _ in range(blocks)], outer, tied


def dp_groups(shape: GPTShape, tp: int, blocks: int, first: bool, last: bool, pp: int, zero: int, dp: int,
              bucket_cap_mb: float = BUCKET_CAP_MB) -> list[int]:
    """Padded elements of each flat group ``ZeroEngine`` builds over a stage (see the module docstring).

    Stages 0-2: the tied copy alone, then the rest in reverse order, in buckets of at most
    ``bucket_cap_mb`` (:func:`~parallel_lib.data_parallel.buckets.make_buckets`, given empty stand-ins of
    the tensors); stage 3: the tied copy, what is outside the blocks, then one group per block.
    Each is padded to a multiple of ``dp``.

    Raises:
        ValueError: a ZeRO stage outside 0-3 or ``dp < 1``.
    """
    check_choice("zero", zero, [0, 1, 2, 3])
    positive_int("dp", dp)
    per_block, outer, tied = stage_tensor_sizes(shape, tp, blocks, first, last, pp)
    if zero == 3:
        groups = [[n] for n in tied] + ([outer] if outer else []) + per_block
    else:  # the stage's parameter order is the blocks, then the rest; ZeroEngine buckets it reversed
        rest = [torch.empty(n, device="meta") for n in [*(n for b in per_block for n in b), *outer][::-1]]
        groups = [[n] for n in tied] + [[t.numel() for t in bucket]
                                        for bucket in make_buckets(rest, int(bucket_cap_mb * 2**20))]
    return [padded_numel(sum(g), dp) for g in groups]


def owned_parameters(groups: list[int], zero: int, dp: int) -> int:
    """Elements this rank updates: every padded group at zero 0, its 1/dp shard of each at zero 1-3."""
    return sum(groups) // (dp if zero >= 1 else 1)


def stage_parameters(shape: GPTShape, tp: int, blocks: int, first: bool, last: bool, pp: int) -> int:
    """Values one rank holds: its stage's blocks split by ``tp``, the embedding on the first stage, ln_f (and
    the head's copy of the embedding slice when ``pp > 1``) on the last.

    With one stage this is chapter 07's :func:`~parallel_lib.tensor_parallel.cost.shard_parameters`.
    """
    h = shape.n_embd
    per_block = (shard_parameters(GPTShape(1, h, shape.n_head, shape.vocab_size, 0), tp)
                 - shape.vocab_size * h // tp - 2 * h)  # one block's shard alone
    total = blocks * per_block
    if first:
        total += shape.vocab_size * h // tp + shape.n_positions * h
    if last:
        total += 2 * h + (shape.vocab_size * h // tp if pp > 1 else 0)
    return total


def _add(into: dict[str, tuple[int, int]], kind: str, calls: int, nbytes: int) -> None:
    if calls:
        old = into.get(kind, (0, 0))
        into[kind] = (old[0] + calls, old[1] + nbytes)


def expected_traffic(shape: GPTShape, dp: int, tp: int, pp: int, j: int, blocks: int, micro_batches: int,
                     rows: int, seq: int, recompute: bool = False, zero: int = 0,
                     bucket_cap_mb: float = BUCKET_CAP_MB) -> Traffic:
    """One step's collectives of a rank on stage ``j``, by group kind (see the module docstring).

    Args:
        shape: the model.
        dp, tp, pp: the mesh.
        j: the rank's stage; ``blocks``: how many blocks it holds.
        micro_batches: per replica and step; ``rows``: rows of each micro-batch.
        seq: positions per row.
        recompute: activations recomputed in backward (the forward's collectives run twice).
        zero: the ZeRO stage over dp, 0-3.
        bucket_cap_mb: ZeroEngine's bucket size.

    Raises:
        ValueError: a ZeRO stage outside 0-3, or ``zero=3`` with ``recompute`` (the recomputed forward
            gathers the layers once more: not in this formula).
    """
    check_choice("zero", zero, [0, 1, 2, 3])
    if zero == 3 and recompute:
        raise ValueError("zero=3 with recompute=True: the recomputed forward gathers each layer group again, "
                         "which this formula does not count; use zero <= 2 or recompute=False")
    first, last = j == 0, j == pp - 1
    act = rows * seq * shape.n_embd * FLOAT
    forwards = 2 if recompute else 1
    traffic: Traffic = {"tp": {}, "pp": {}, "dp": {}, "tied": {}}
    if tp > 1:
        layer = layer_collectives(rows, seq, shape.n_embd)
        for phase, times in (("forward", forwards), ("backward", 1)):
            calls, nbytes = layer[phase]["all_reduce"]
            _add(traffic["tp"], "all_reduce", micro_batches * times * blocks * calls,
                 micro_batches * times * blocks * nbytes)
        if first:  # the vocabulary-parallel embedding's g
            _add(traffic["tp"], "all_reduce", micro_batches * forwards, micro_batches * forwards * act)
        if last:  # the head's f (backward) and the loss: max, target logit, sum of exp of b·s floats
            _add(traffic["tp"], "all_reduce", micro_batches, micro_batches * act)
            _add(traffic["tp"], "all_reduce", 3 * micro_batches * forwards, 3 * micro_batches * forwards * rows * seq
                 * FLOAT)
    sends = micro_batches * ((not last) + (not first))  # activations forward, gradients backward
    recvs = micro_batches * ((not first) + (not last))
    _add(traffic["pp"], "send", sends, sends * act)
    _add(traffic["pp"], "recv", recvs, recvs * act)
    groups = dp_groups(shape, tp, blocks, first, last, pp, zero, dp, bucket_cap_mb)
    if dp > 1:  # every padded flat group, whole: the counter records a reduce-scatter's input, an all-gather's output
        for kind, (calls, nbytes) in zero_collectives([g * FLOAT for g in groups], zero, micro_batches).items():
            _add(traffic["dp"], kind, calls, int(nbytes))
    if pp > 1 and (first or last):  # the tied copy's group comes first
        _add(traffic["tied"], "all_reduce", 1, groups[0] // (dp if zero >= 1 else 1) * FLOAT)
    return traffic


def state_bytes(groups: list[int], zero: int, dp: int) -> int:
    """The census of a rank's model state between backward and step, from its padded flat groups.

    :func:`~parallel_lib.sharding.memory.zero_memory` of ``sum(groups)`` values in fp32 over ``dp``
    ranks at ``zero``, plus torch AdamW's step count: one float32 value per flat group (the
    optimizer steps one flat tensor per group). From the second step on (the first step's census
    comes before AdamW has created its state).
    """
    memory = zero_memory(sum(groups), dp, zero, "fp32")
    return round(memory["total"]) + FLOAT * len(groups)


def group_sizes(mesh: Any) -> dict[str, int]:
    """Ranks per group kind of a :class:`~parallel_lib.runtime.mesh.Mesh` (2 for send/recv and tied)."""
    return {"tp": mesh.tp, "pp": 2, "dp": mesh.dp, "tied": 2}
