"""The same GPT-2 split by PyTorch's own tensor parallelism (DTensor), for comparison.

``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` and
``RowwiseParallel`` on a ``DeviceMesh`` does what :mod:`.layers` does, with DTensors:
it shards ``nn.Linear`` weights and inserts the collectives itself. It shards a layer's
output features into *contiguous* pieces, so given GPT-2's fused ``c_attn`` as is, it
makes the classic mistake (rank 0 gets the queries and half the keys). The fix is the
one of :func:`.split.qkv_rows`: reorder the fused rows so that contiguous pieces are
each rank's heads of q, k and v. The blocks then run the very forward of :mod:`.gpt2`.
The embedding and the head stay whole here (DTensor would need a custom plan for the
vocabulary-parallel loss).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel

from parallel_lib.tensor_parallel.convert import dense_linear
from parallel_lib.tensor_parallel.gpt2 import ParallelBlock, TensorParallelGPT2
from parallel_lib.tensor_parallel.split import check_divisible, qkv_rows

__all__ = ["dtensor_parallelize", "dtensor_check"]


def dtensor_parallelize(model: GPT2LMHeadModel, mesh: Any, reorder_qkv: bool = True) -> TensorParallelGPT2:
    """``model`` as :class:`.TensorParallelGPT2` whose linear layers PyTorch's ``parallelize_module`` split.

    Args:
        model: a dense ``GPT2LMHeadModel`` (copied, not changed).
        mesh: a 1-D ``DeviceMesh`` over the tensor-parallel ranks.
        reorder_qkv: put each rank's heads of q, k, v next to each other before
            ``ColwiseParallel`` cuts ``c_attn``; False shows what happens without.

    Raises:
        ValueError: heads not divisible by the mesh's size.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, config = mesh.size(), model.config
    check_divisible("n_head", config.n_head, tp, hint="choose a mesh size that divides the number of heads")
    order = torch.cat([qkv_rows(config.n_embd, config.n_head, r, tp) for r in range(tp)])
    plan = {"c_attn": ColwiseParallel(), "c_proj": RowwiseParallel(),
            "c_fc": ColwiseParallel(), "mlp_proj": RowwiseParallel()}
    blocks = []
    for block in model.transformer.h:
        c_attn = dense_linear(block.attn.c_attn)
        if reorder_qkv:
            with torch.no_grad():
                c_attn.weight.copy_(c_attn.weight[order])
                c_attn.bias.copy_(c_attn.bias[order])
        mine = ParallelBlock(copy.deepcopy(block.ln_1), c_attn, dense_linear(block.attn.c_proj),
                             copy.deepcopy(block.ln_2), dense_linear(block.mlp.c_fc), dense_linear(block.mlp.c_proj),
                             config.n_embd // config.n_head)
        blocks.append(parallelize_module(mine, mesh, plan))
    t = model.transformer
    return TensorParallelGPT2(config, copy.deepcopy(t.wte), copy.deepcopy(t.wpe), blocks, copy.deepcopy(t.ln_f),
                              group=mesh.get_group(), vocab_parallel=False)


def dtensor_check(rank: int, world_size: int, config: Any) -> dict[str, float]:
    """Our split and DTensor's on one padded batch: the largest differences of logits and c_attn gradients.

    Returns ``{"logits", "loss", "c_attn_grad", "naive_logits"}``; ``naive_logits`` is
    DTensor on the fused ``c_attn`` without the reordering (expected to be far off).
    """
    from torch.distributed.device_mesh import init_device_mesh

    from parallel_lib.common.models import build_gpt2
    from parallel_lib.tensor_parallel import regions as R
    from parallel_lib.tensor_parallel.convert import tensor_parallelize
    from parallel_lib.tensor_parallel.train import make_batches

    mesh = init_device_mesh("cpu", (world_size,))
    dense = build_gpt2(config.model, config.vocab_size, config.seed, **config.overrides())
    batch = make_batches(config)[0]
    ids, mask, labels, weights = batch["input_ids"], batch["attention_mask"], batch["labels"], batch["label_token_weights"]
    ours, theirs = tensor_parallelize(dense), dtensor_parallelize(dense, mesh)
    our_logits = ours(ids, mask)
    ours.loss(our_logits, labels, weights).backward()
    their_logits = theirs(ids, mask)
    ce = F.cross_entropy(their_logits.flatten(0, 1), labels.flatten(), reduction="none")
    their_loss = (ce * weights.flatten()).sum() / weights.sum()
    their_loss.backward()
    keep = mask.bool()
    gathered = R._all_gather(our_logits.detach(), -1, None)
    their_grad = theirs.h[0].c_attn.weight.grad.to_local()
    naive = dtensor_parallelize(dense, mesh, reorder_qkv=False)(ids, mask).detach()
    return dict(logits=float((gathered[keep] - their_logits.detach()[keep]).abs().max()),
                loss=abs(float(ours.loss(our_logits.detach(), labels, weights)) - float(their_loss.detach())),
                c_attn_grad=float((ours.h[0].c_attn.weight.grad - their_grad).abs().max()),
                naive_logits=float((naive[keep] - their_logits.detach()[keep]).abs().max()))

