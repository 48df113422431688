"""What one rank of a DP × TP × PP run holds and sends per step: the formulas the counter is checked against.

Rank ``(d, j, t)`` holds slice t of stage j. Per step, with ``m`` micro-batches of ``b``
rows, sequence ``s``, width ``h``, 4-byte floats:

- **tp** (its stage's tensor-parallel group, when tp > 1): chapter 07's collectives, per
  micro-batch, for its own blocks only (:func:`~parallel_lib.tensor_parallel.cost.layer_collectives`:
  2 all-reduces of ``b·s·h`` forward, 2 backward), plus the embedding's forward ``g`` on
  the first stage and the head's backward ``f`` and the loss's 3 all-reduces of ``b·s``
  values on the last. With recomputation the forward runs twice, its all-reduces too.
  Summed over the stages this is :func:`~parallel_lib.tensor_parallel.cost.step_collectives`
  per micro-batch: splitting the layers over stages moves no collective.
- **pp** (send/recv with the same slice of the neighbouring stages): one boundary's
  activations ``b·s·h`` per micro-batch forward (not from the last stage) and its gradient
  backward (not from the first): ``p2p_bytes`` of the planner, per micro-batch.
- **dp** (the same slice of the same stage in every replica, when dp > 1): one bucketed
  all-reduce of the stage's gradients, ``S`` bytes, so ``2(dp-1)/dp · S`` on the wire.
- **tied** (first and last stage of the same slice, when pp > 1): the vocabulary slice of
  the tied embedding, ``V/t · h``, summed over the two.
"""

from __future__ import annotations

from typing import Any

from parallel_lib.runtime.collectives import ring_wire_bytes
from parallel_lib.tensor_parallel.cost import GPTShape, layer_collectives, shard_parameters

__all__ = ["stage_parameters", "expected_traffic", "wire_bytes", "stage_tensors", "state_bytes", "group_sizes", "FLOAT"]

FLOAT = 4  # bytes per element: the runs train in float32
Traffic = dict[str, dict[str, tuple[int, int]]]  # group kind -> {collective: (calls, message bytes)}


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
                     rows: int, seq: int, recompute: bool = False) -> Traffic:
    """One step's collectives of a rank on stage ``j``, by group kind (see the module docstring).

    Args:
        shape: the model.
        dp, tp, pp: the grid.
        j: the rank's stage; ``blocks``: how many blocks it holds.
        micro_batches: per replica and step; ``rows``: rows of each micro-batch.
        seq: positions per row.
        recompute: activations recomputed in backward (the forward's collectives run twice).
    """
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
    params = stage_parameters(shape, tp, blocks, first, last, pp)
    if dp > 1:  # one bucket: the course's tiny and small stages are far below the 25 MB cap
        _add(traffic["dp"], "all_reduce", 1, params * FLOAT)
    if pp > 1 and (first or last):
        _add(traffic["tied"], "all_reduce", 1, shape.vocab_size // tp * shape.n_embd * FLOAT)
    return traffic


def wire_bytes(traffic: dict[str, tuple[int, int]], group_size: int) -> float:
    """Bytes this rank sends for one group's collectives under the ring algorithm."""
    return sum(ring_wire_bytes(kind, nbytes, group_size) for kind, (_, nbytes) in traffic.items())


def stage_tensors(blocks: int, first: bool, last: bool, pp: int) -> int:
    """Parameter tensors of a stage: 12 per block, wte and wpe first, ln_f (and the head's copy) last."""
    return 12 * blocks + 2 * first + (2 + (pp > 1)) * last


def state_bytes(parameters: int, optimizer: str, tensors: int = 0) -> int:
    """Parameters + gradients + optimizer states in float32: AdamW keeps two states per value, SGD none.

    torch's AdamW also keeps its step count as a one-value float32 tensor per parameter tensor:
    ``tensors`` of them add 4 bytes each (0.04 % of tiny GPT-2's states; pass 0 to leave them out).
    """
    states = {"adamw": 2, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"optimizer must be one of {sorted(states)}, got optimizer={optimizer!r}")
    return parameters * FLOAT * (2 + states[optimizer]) + (FLOAT * tensors if optimizer == "adamw" else 0)


def group_sizes(mesh: Any) -> dict[str, int]:
    """Ranks per group kind of a :class:`~parallel_lib.runtime.mesh.Mesh` (2 for send/recv and tied)."""
    return {"tp": mesh.tp, "pp": 2, "dp": mesh.dp, "tied": 2}
