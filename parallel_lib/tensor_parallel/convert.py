"""From a dense GPT-2 to one rank's shard (:func:`tensor_parallelize`) and back (:func:`gather_dense`).

Every rank builds the same dense model (``build_gpt2`` with one seed) and keeps its
slices; nothing is sent. Hugging Face's ``Conv1D`` stores weights as (in, out), so each
is transposed to ``nn.Linear``'s (out, in) first; ``c_attn`` is then cut by heads
(:func:`.split.qkv_rows`), never into contiguous thirds. The split itself is
:func:`.parallelize.parallelize_tp` on the one GPT-2; this module copies the dense model
first (it is not changed) and gathers a shard back into the dense layout.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn
from transformers import GPT2LMHeadModel

from parallel_lib.common.checks import check_int
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import from_hf
from parallel_lib.models.linear import Conv1D
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.parallelize import parallelize_tp
from parallel_lib.tensor_parallel.split import naive_qkv_rows, qkv_rows

__all__ = ["tensor_parallelize", "gather_dense"]


def tensor_parallelize(model: Any, group: Any = None, sequence_parallel: bool = False, dropout_seed: int = 0,
                       naive_qkv: bool = False, vocab_parallel: bool = True, dropout_replica: int = 0) -> GPT2:
    """This rank's shard of a dense GPT-2 (a copy): attention and MLP split by heads, vocabulary split by rows.

    Call it on every rank of ``group`` with the same dense model. The dense model is not changed.

    Args:
        model: a dense Hugging Face ``GPT2LMHeadModel`` or the one :class:`~parallel_lib.models.GPT2`.
        group: the tensor-parallel process group or a ``RankMesh`` (None: the default group; without
            ``torch.distributed`` initialised, one rank holding everything).
        sequence_parallel, naive_qkv, vocab_parallel: see :func:`.parallelize.parallelize_tp`.
        dropout_seed: seed of the dropout masks (:mod:`parallel_lib.models.dropout`).
        dropout_replica: the data-parallel replica this shard trains in; each replica draws its own
            masks (0: the masks one process draws).

    Raises:
        TypeError: ``model`` is neither. ValueError: see :func:`.parallelize.check_tp_split`;
        ``dropout_seed`` not an int, or ``dropout_replica`` not an int >= 0.
    """
    if isinstance(model, GPT2LMHeadModel):
        dense = from_hf(model, dropout_seed)
    elif isinstance(model, GPT2):
        if getattr(model, "tp_info", None) is not None:
            raise ValueError("model is already tensor-parallel; split the dense model, or call gather_dense(model) "
                             "first to get it back")
        dense = copy.deepcopy(model)
    else:
        raise TypeError(f"model must be a Hugging Face GPT2LMHeadModel (e.g. build_gpt2('tiny')) or the one GPT2 "
                        f"(parallel_lib.models), got {type(model).__name__}")
    dense.dropout_stream.seed = check_int("dropout_seed", dropout_seed)
    dense.dropout_stream.replica = check_int("dropout_replica", dropout_replica, minimum=0)
    return parallelize_tp(dense, group, sequence_parallel, vocab_parallel, naive_qkv)


def _to_conv1d(conv1d: Conv1D, linear: nn.Linear, order: Optional[torch.Tensor] = None) -> None:
    with torch.no_grad():
        weight, bias = linear.weight, linear.bias
        if order is not None:  # gathered rows come rank by rank: put them back at their dense positions
            weight = torch.empty_like(weight).index_copy_(0, order, weight)
            bias = torch.empty_like(bias).index_copy_(0, order, bias)
        conv1d.weight.copy_(weight.t())
        conv1d.bias.copy_(bias)


def gather_dense(model: GPT2) -> GPT2:
    """The dense GPT-2 that ``model``'s shards make up (a collective: call it on every rank of the group).

    Its state dict is Hugging Face's (``to_hf`` of it gives a ``GPT2LMHeadModel``).

    Raises:
        TypeError: ``model`` is not a GPT-2 split by :func:`.parallelize.parallelize_tp`.
    """
    info = getattr(model, "tp_info", None)
    if not isinstance(model, GPT2) or info is None:
        raise TypeError(f"model must be a tensor-parallel GPT2 (from tensor_parallelize or parallelize_tp), got "
                        f"{type(model).__name__}{'' if info else ' without tp_info'}")
    config, tp, group = model.config, info.tp, info.group
    first = next(model.parameters())
    dense = GPT2(config, seed=model.dropout_stream.seed).to(first.device, first.dtype)
    dense.dropout_stream.replica = model.dropout_stream.replica
    rows = (lambda r: naive_qkv_rows(config.n_embd, r, tp)) if info.naive_qkv else \
        (lambda r: qkv_rows(config.n_embd, config.n_head, r, tp))
    order = torch.cat([rows(r) for r in range(tp)]).to(first.device)
    mine, theirs = model.transformer, dense.transformer
    with torch.no_grad():
        wte = mine.wte.weight.detach()
        theirs.wte.weight.copy_(R._all_gather(wte, 0, group) if info.vocab_parallel else wte)
        theirs.wpe.weight.copy_(mine.wpe.weight)
        theirs.ln_f.load_state_dict(mine.ln_f.state_dict())
        for a, b in zip(mine.h, theirs.h):
            b.ln_1.load_state_dict(a.ln_1.state_dict())
            b.ln_2.load_state_dict(a.ln_2.state_dict())
            _to_conv1d(b.attn.c_attn, a.attn.c_attn.to_dense(), order)
            _to_conv1d(b.attn.c_proj, a.attn.c_proj.to_dense())
            _to_conv1d(b.mlp.c_fc, a.mlp.c_fc.to_dense())
            _to_conv1d(b.mlp.c_proj, a.mlp.c_proj.to_dense())
    return dense.train(model.training)
