"""From a dense Hugging Face GPT-2 to one rank's shard (:func:`tensor_parallelize`) and back (:func:`gather_dense`).

Every rank builds the same dense model (``build_gpt2`` with one seed) and keeps its
slices; nothing is sent. Hugging Face's ``Conv1D`` stores weights as (in, out), so each
is transposed to ``nn.Linear``'s (out, in) first; ``c_attn`` is then cut by heads
(:func:`.split.qkv_rows`), never into contiguous thirds.
"""

from __future__ import annotations

import copy

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from transformers import GPT2LMHeadModel

from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.gpt2 import ParallelBlock, TensorParallelGPT2
from parallel_lib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel_lib.tensor_parallel.split import check_divisible, conv1d_as_linear_weight, naive_qkv_rows, qkv_rows
from parallel_lib.tensor_parallel.vocab import VocabParallelEmbedding, vocab_range

__all__ = ["check_tensor_parallel", "tensor_parallelize", "gather_dense", "dense_linear"]


def dense_linear(conv1d: nn.Module) -> nn.Linear:
    """A Hugging Face ``Conv1D`` (weight (in, out)) as the equivalent ``nn.Linear`` (weight (out, in))."""
    weight = conv1d_as_linear_weight(conv1d.weight)
    linear = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(conv1d.bias)
    return linear


def _clone(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)  # layer norms and position embeddings: whole on every rank


def check_tensor_parallel(model: Any, group: Any) -> int:
    """The tensor-parallel size for splitting ``model`` over ``group``, after checking both.

    Raises:
        TypeError: ``model`` is not a Hugging Face ``GPT2LMHeadModel``.
        ValueError: ``model`` is already split; this rank is not in ``group``; heads, width,
            MLP width or vocabulary not divisible by the group's size.
    """
    if isinstance(model, TensorParallelGPT2):
        raise ValueError("model is already tensor-parallel (a TensorParallelGPT2); split the dense model, "
                         "or call gather_dense(model) first to get it back")
    if not isinstance(model, GPT2LMHeadModel):
        raise TypeError(f"model must be a Hugging Face GPT2LMHeadModel (e.g. build_gpt2('tiny')), "
                        f"got {type(model).__name__}")
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(f"group does not contain this process (global rank {dist.get_rank()}, group ranks "
                         f"{dist.get_process_group_ranks(group)}); pass the tensor-parallel group this rank is in")
    tp, config = R.group_size(group), model.config
    check_divisible("n_head", config.n_head, tp, hint="choose a tensor-parallel size that divides the number of heads")
    check_divisible("n_inner", config.n_inner or 4 * config.n_embd, tp)
    vocab_range(config.vocab_size, 0, tp)
    return tp


def tensor_parallelize(model: GPT2LMHeadModel, group: Any = None, sequence_parallel: bool = False,
                       dropout_seed: int = 0, naive_qkv: bool = False) -> TensorParallelGPT2:
    """This rank's shard of a dense GPT-2: attention and MLP split by heads, vocabulary split by rows.

    Call it on every rank of ``group`` with the same dense model. The dense model is not
    changed (its weights are copied).

    Args:
        model: a dense ``GPT2LMHeadModel``.
        group: the tensor-parallel process group (None: the default group; without
            ``torch.distributed`` initialised, one rank holding everything).
        sequence_parallel: keep the residual stream, layer norms and dropout on 1/t of the sequence.
        dropout_seed: seed of the dropout masks (see :mod:`.gpt2`).
        naive_qkv: split ``c_attn`` into contiguous pieces instead of by heads: the classic
            mistake, kept so the chapter can show it failing.

    Raises:
        TypeError, ValueError: see :func:`check_tensor_parallel`.
    """
    tp = check_tensor_parallel(model, group)
    rank, config = R.group_rank(group), model.config
    transformer, head_dim = model.transformer, config.n_embd // config.n_head
    rows = naive_qkv_rows(config.n_embd, rank, tp) if naive_qkv else qkv_rows(config.n_embd, config.n_head, rank, tp)
    blocks = []
    for block in transformer.h:
        attn, mlp = block.attn, block.mlp
        c_attn = dense_linear(attn.c_attn)
        blocks.append(ParallelBlock(
            _clone(block.ln_1),
            ColumnParallelLinear(c_attn.weight[rows], c_attn.bias[rows], group, sequence_parallel=sequence_parallel),
            RowParallelLinear.from_dense(dense_linear(attn.c_proj), group, sequence_parallel=sequence_parallel),
            _clone(block.ln_2),
            ColumnParallelLinear.from_dense(dense_linear(mlp.c_fc), group, sequence_parallel=sequence_parallel),
            RowParallelLinear.from_dense(dense_linear(mlp.c_proj), group, sequence_parallel=sequence_parallel),
            head_dim))
    wte = VocabParallelEmbedding.from_dense(transformer.wte, group, sequence_parallel=sequence_parallel)
    return TensorParallelGPT2(config, wte, _clone(transformer.wpe), blocks, _clone(transformer.ln_f), group,
                              sequence_parallel, vocab_parallel=True, vocab_start=wte.vocab_start,
                              dropout_seed=dropout_seed)


def _to_conv1d(conv1d: nn.Module, linear: nn.Linear, order: Optional[torch.Tensor] = None) -> None:
    with torch.no_grad():
        weight, bias = linear.weight, linear.bias
        if order is not None:  # gathered rows come rank by rank: put them back at their dense positions
            weight, bias = torch.empty_like(weight).index_copy_(0, order, weight), torch.empty_like(bias).index_copy_(0, order, bias)
        conv1d.weight.copy_(weight.t())
        conv1d.bias.copy_(bias)


def gather_dense(model: TensorParallelGPT2) -> GPT2LMHeadModel:
    """The dense ``GPT2LMHeadModel`` that ``model``'s shards make up (a collective: call it on every rank).

    Raises:
        TypeError: ``model`` is not a :class:`TensorParallelGPT2`.
    """
    if not isinstance(model, TensorParallelGPT2):
        raise TypeError(f"model must be a TensorParallelGPT2 (from tensor_parallelize), got {type(model).__name__}")
    config, tp = model.config, model.tp
    with torch.random.fork_rng(devices=[]):
        dense = GPT2LMHeadModel(config)
    order = torch.cat([qkv_rows(config.n_embd, config.n_head, r, tp) for r in range(tp)])
    t = dense.transformer
    with torch.no_grad():
        t.wte.weight.copy_(R._all_gather(model.wte.weight.detach(), 0, model.group))
        t.wpe.load_state_dict(model.wpe.state_dict())
        t.ln_f.load_state_dict(model.ln_f.state_dict())
        for mine, theirs in zip(model.h, t.h):
            theirs.ln_1.load_state_dict(mine.ln_1.state_dict())
            theirs.ln_2.load_state_dict(mine.ln_2.state_dict())
            _to_conv1d(theirs.attn.c_attn, mine.c_attn.to_dense(), order)
            _to_conv1d(theirs.attn.c_proj, mine.c_proj.to_dense())
            _to_conv1d(theirs.mlp.c_fc, mine.c_fc.to_dense())
            _to_conv1d(theirs.mlp.c_proj, mine.mlp_proj.to_dense())
    dense.tie_weights()
    return dense
