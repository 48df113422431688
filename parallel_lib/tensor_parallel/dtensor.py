"""The same GPT-2 split by PyTorch's own tensor parallelism (DTensor), for comparison.

``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` and
``RowwiseParallel`` on a ``DeviceMesh`` does what :mod:`.layers` does, with DTensors:
it shards ``nn.Linear`` weights and inserts the collectives itself. It shards a layer's
output features into *contiguous* pieces, so given GPT-2's fused ``c_attn`` as is, it
makes the classic mistake (rank 0 gets the queries and half the keys). The fix is the
one of :func:`.split.qkv_rows`: reorder the fused rows so that contiguous pieces are
each rank's heads of q, k and v. The blocks then run the one GPT-2's own forward
(:mod:`parallel_lib.models`), as our split does.
The embedding and the head stay whole here (DTensor would need a custom plan for the
vocabulary-parallel loss).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import from_hf
from parallel_lib.tensor_parallel.parallelize import as_linear
from parallel_lib.tensor_parallel.split import check_divisible, qkv_rows

__all__ = ["dtensor_parallelize", "dtensor_check"]


def dtensor_parallelize(model: Any, mesh: Any, reorder_qkv: bool = True) -> GPT2:
    """The one GPT-2 (a copy of ``model``) whose blocks' linear layers PyTorch's ``parallelize_module`` split.

    Args:
        model: a dense ``GPT2LMHeadModel`` or the one GPT-2 (copied, not changed).
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
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    ours = copy.deepcopy(model) if isinstance(model, GPT2) else from_hf(model)
    for block in ours.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn, attn.c_proj = as_linear(attn.c_attn), as_linear(attn.c_proj)  # DTensor splits nn.Linear
        mlp.c_fc, mlp.c_proj = as_linear(mlp.c_fc), as_linear(mlp.c_proj)
        if reorder_qkv:
            with torch.no_grad():
                attn.c_attn.weight.copy_(attn.c_attn.weight[order])
                attn.c_attn.bias.copy_(attn.c_attn.bias[order])
        parallelize_module(block, mesh, plan)
    return ours


def dtensor_check(rank: int, world_size: int, config: Any) -> dict[str, float]:
    """Our split and DTensor's on one padded batch: the largest differences of logits and c_attn gradients.

    Returns ``{"logits", "loss", "c_attn_grad", "naive_logits"}``; ``naive_logits`` is
    DTensor on the fused ``c_attn`` without the reordering (expected to be far off).
    """
    from torch.distributed.device_mesh import init_device_mesh

    from parallel_lib.common.models import build_gpt2
    from parallel_lib.tensor_parallel import regions as R
    from parallel_lib.tensor_parallel.convert import tensor_parallelize
    from parallel_lib.tensor_parallel.batches import make_batches

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
    their_grad = theirs.transformer.h[0].attn.c_attn.weight.grad.to_local()
    naive = dtensor_parallelize(dense, mesh, reorder_qkv=False)(ids, mask).detach()
    return dict(logits=max_abs_difference(gathered[keep], their_logits[keep]),
                loss=max_abs_difference(ours.loss(our_logits.detach(), labels, weights), their_loss),
                c_attn_grad=max_abs_difference(ours.transformer.h[0].attn.c_attn.weight.grad, their_grad),
                naive_logits=max_abs_difference(naive[keep], their_logits[keep]))
