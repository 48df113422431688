"""Tensor parallelism applied to the one GPT-2: chapter 07's parts swapped into the model, in place.

One block after :func:`parallelize_tp` (Megatron-LM's split; ``f``/``g`` from :mod:`.regions`)::

    x ─ ln_1 ─ f ─ attn.c_attn (column: my heads of q, k, v) ─ attention on my heads ─ attn.c_proj (row) ─ g ─ +x
    x ─ ln_2 ─ f ─ mlp.c_fc   (column: 4h/t features) ─ gelu ─ mlp.c_proj (row) ─ g ─ +x

so a block costs two all-reduces of (b, s, h) forward (the two ``g``) and two backward (the
two ``f``). The token embedding and the head hold 1/t of the vocabulary each
(:mod:`.vocab`). With ``sequence_parallel`` the residual stream, the layer norms and the
dropouts hold 1/t of the sequence, and ``f``/``g`` become all-gather / reduce-scatter.

Nothing else changes: the model's own attention, blocks and forward run on whatever heads
and tokens a rank holds, which is why one model serves every strategy. The fused
``c_attn`` is cut by heads (:func:`.split.qkv_rows`); ``naive_qkv`` cuts it into contiguous
pieces instead, the mistake chapter 07 shows failing.

**Dropout.** Each dropout site is told which slice of the whole tensor its input is (my heads
for the attention probabilities; my tokens for the others under sequence parallelism), so it
drops exactly what one process drops (:mod:`parallel_lib.models.dropout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.models.gpt2 import GPT2, Block
from parallel_lib.models.linear import Conv1D
from parallel_lib.runtime.mesh import RankMesh
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel_lib.tensor_parallel.sequence import SequenceParallelPositions, mark_sequence_parallel
from parallel_lib.tensor_parallel.split import check_divisible, naive_qkv_rows, qkv_rows
from parallel_lib.tensor_parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_range

__all__ = ["TPInfo", "tp_group_of", "check_tp_split", "split_block", "parallelize_tp", "as_linear"]


@dataclass(frozen=True)
class TPInfo:
    """How a model was split (``model.tp_info``): its group, this rank, and the options."""

    group: Any
    tp: int
    rank: int
    sequence_parallel: bool
    vocab_parallel: bool
    naive_qkv: bool = False
    vocab_start: int = 0  # the first token id this rank's embedding and logits hold


def tp_group_of(mesh_or_group: Any) -> Any:
    """The tensor-parallel process group: ``mesh.group("tp")`` of a ``RankMesh``, or the group itself.

    ``None`` means the default group (or one rank holding everything when ``torch.distributed``
    is not initialised): kept for the one-process references; new code passes a mesh or a group.
    """
    if isinstance(mesh_or_group, RankMesh):
        return mesh_or_group.group("tp")
    return mesh_or_group


def check_tp_split(model: Any, group: Any, vocab_parallel: bool = True) -> int:
    """The tensor-parallel size for splitting ``model`` over ``group``, after checking both.

    ``vocab_parallel=False`` (the embedding and the head stay whole) needs no divisible vocabulary.

    Raises:
        TypeError: ``model`` is not the one :class:`~parallel_lib.models.GPT2`.
        ValueError: ``model`` is already split; this rank is not in ``group``; heads, MLP width
            or vocabulary (when split) not divisible by the group's size.
    """
    if not isinstance(model, GPT2):
        raise TypeError(f"model must be the one GPT2 (parallel_lib.models.build_model, or from_hf of a Hugging "
                        f"Face GPT2LMHeadModel), got {type(model).__name__}")
    if getattr(model, "tp_info", None) is not None:
        raise ValueError("model is already tensor-parallel; split the dense model, or call gather_dense(model) "
                         "first to get it back")
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(f"group does not contain this process (global rank {dist.get_rank()}, group ranks "
                         f"{dist.get_process_group_ranks(group)}); pass the tensor-parallel group this rank is in")
    tp, config = R.group_size(group), model.config
    check_divisible("n_head", config.n_head, tp, hint="choose a tensor-parallel size that divides the number of heads")
    check_divisible("n_inner", config.n_inner or 4 * config.n_embd, tp)
    if vocab_parallel:
        vocab_range(config.vocab_size, 0, tp)
    return tp


def as_linear(conv1d: Conv1D) -> nn.Linear:
    """A GPT-2 ``Conv1D`` (weight (in, out)) as the equivalent ``nn.Linear`` (weight (out, in)): a copy."""
    weight = conv1d.linear_weight()
    linear = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(conv1d.bias)
    return linear


def split_block(block: Block, group: Any, sequence_parallel: bool = False, naive_qkv: bool = False) -> Block:
    """One block of the one GPT-2 split in place over ``group`` (see the module docstring); returns it.

    :func:`parallelize_tp` splits every block this way; a serving stage splits only its own.

    Raises:
        ValueError: heads or MLP width not divisible by the group's size.
    """
    tp, rank = R.group_size(group), R.group_rank(group)
    attn, mlp = block.attn, block.mlp
    n_embd = attn.c_attn.in_features
    n_head = n_embd // attn.head_dim
    rows = naive_qkv_rows(n_embd, rank, tp) if naive_qkv else qkv_rows(n_embd, n_head, rank, tp)
    sp = dict(sequence_parallel=sequence_parallel)
    c_attn = as_linear(attn.c_attn)
    attn.c_attn = ColumnParallelLinear(c_attn.weight[rows], c_attn.bias[rows], group, **sp)
    attn.c_proj = RowParallelLinear.from_dense(as_linear(attn.c_proj), group, **sp)
    mlp.c_fc = ColumnParallelLinear.from_dense(as_linear(mlp.c_fc), group, **sp)
    mlp.c_proj = RowParallelLinear.from_dense(as_linear(mlp.c_proj), group, **sp)
    for part, label in ((attn.c_attn, "attention"), (attn.c_proj, "attention"), (mlp.c_fc, "mlp"), (mlp.c_proj, "mlp")):
        part.label = label  # names the recorded f/g events (chapter 07's widget)
    attn.attn_dropout.split(1, rank, tp)  # (b, heads, s, s): my heads
    if sequence_parallel:  # (b, s, h): my tokens
        attn.resid_dropout.split(1, rank, tp)
        mlp.dropout.split(1, rank, tp)
        mark_sequence_parallel(block.ln_1)
        mark_sequence_parallel(block.ln_2)
    return block


def parallelize_tp(model: GPT2, mesh_or_group: Any, sequence_parallel: bool = False, vocab_parallel: bool = True,
                   naive_qkv: bool = False) -> GPT2:
    """Split ``model`` in place into this rank's shard (see the module docstring); returns it.

    Call it on every rank of the group with the same dense model (the same seed). Afterwards
    ``model(ids, mask)`` gives this rank's logits (b, s, V/t) (all V without ``vocab_parallel``),
    ``model.loss`` their weighted cross-entropy without gathering them, and ``model.tp_info``
    says how it was split.

    Args:
        model: the one GPT-2, dense.
        mesh_or_group: a ``RankMesh`` (its ``"tp"`` axis is used) or the tensor-parallel process group.
        sequence_parallel: keep the residual stream, layer norms and dropouts on 1/t of the sequence.
        vocab_parallel: split the embedding and head by vocabulary (False: both stay whole, as
            serving keeps them: then only the blocks communicate).
        naive_qkv: cut ``c_attn`` into contiguous pieces instead of by heads (the classic mistake).

    Raises:
        TypeError, ValueError: see :func:`check_tp_split`; ``sequence_parallel`` without ``vocab_parallel``.
    """
    group = tp_group_of(mesh_or_group)
    tp = check_tp_split(model, group, vocab_parallel)
    if sequence_parallel and not vocab_parallel:
        raise ValueError("sequence_parallel=True needs vocab_parallel=True (the vocabulary-parallel embedding "
                         "reduce-scatters the sequence); pass vocab_parallel=True")
    rank, config, t = R.group_rank(group), model.config, model.transformer
    for block in t.h:
        split_block(block, group, sequence_parallel, naive_qkv)
    if vocab_parallel:
        t.wte = VocabParallelEmbedding.from_dense(t.wte, group, sequence_parallel=sequence_parallel)
        model.lm_head = VocabParallelHead(t.wte)  # tied: the same shard
    if sequence_parallel:
        t.wpe = SequenceParallelPositions.from_dense(t.wpe, group)
        t.drop.split(1, rank, tp)
        mark_sequence_parallel(t.ln_f)
    start = vocab_range(config.vocab_size, rank, tp)[0] if vocab_parallel else 0
    model.tp_info = TPInfo(group, tp, rank, sequence_parallel, vocab_parallel, naive_qkv, start)
    return model
