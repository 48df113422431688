"""A memory dry run at real scale: PyTorch's own FSDP2 over a fake process group, on the meta device.

The planner's memory formulas are checked on this machine against a tiny model's tensor census;
at 1,024 ranks of a 1.5 B or 8 B model nothing can be run here. PyTorch can still *shard* such a
model without memory or peers: the model is built on the meta device (shapes, no storage), a
``"fake"`` process group (``torch.testing``'s ``FakeStore``) stands for ``world_size`` ranks in this one
process, and ``fully_shard`` (FSDP2) lays out each rank's shards exactly as it would on GPUs. Every
shard's ``to_local()`` then has the size that rank would hold: with FSDP2's padding of each
tensor's first dimension to ``world_size`` chunks, which :func:`parallel_lib.cost.zero.fsdp_shard_numel`
predicts and ``Ψ / N`` misses (GPT-2 XL at 1,024 ranks: 1.22 × ``Ψ / N``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.cost.zero import fsdp_shard_numel
from parallel_lib.sharding.layers import layer_modules
from parallel_lib.tensor_parallel.cost import GPTShape

__all__ = ["meta_model", "fsdp_local_numel", "dry_run_rows"]


def meta_model(shape: GPTShape) -> nn.Module:
    """Hugging Face's model of ``shape`` on the meta device: ``GPT2LMHeadModel``, or ``LlamaForCausalLM``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        if shape.bias and not shape.rms_norm:
            return GPT2LMHeadModel(GPT2Config(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                                              vocab_size=shape.vocab_size, n_positions=shape.n_positions,
                                              n_inner=shape.ffn_hidden or None))
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=shape.n_embd, intermediate_size=shape.ffn, num_hidden_layers=shape.n_layer,
            num_attention_heads=shape.n_head, num_key_value_heads=shape.kv_heads or shape.n_head,
            vocab_size=shape.vocab_size, max_position_embeddings=shape.n_positions,
            tie_word_embeddings=shape.tied_head))


def fsdp_local_numel(shape: GPTShape, world_size: int, rank: int = 0) -> int:
    """Elements ``rank`` holds after ``fully_shard`` of every block and then the root, over ``world_size`` ranks.

    Raises:
        RuntimeError: a process group already exists in this process (the dry run needs its own).
        ValueError: ``world_size < 1`` or ``rank`` outside ``0..world_size-1``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n = positive_int("world_size", world_size)
    check_int("rank", rank, 0, n - 1)
    if dist.is_initialized():
        raise RuntimeError("the dry run starts its own fake process group: call it where none is initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    try:
        mesh = init_device_mesh("cpu", (n,))
        model = meta_model(shape)
        for block in layer_modules(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return sum(p.to_local().numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def dry_run_rows(shapes: dict[str, GPTShape], world_sizes: Sequence[int] = (8, 64, 256, 1024)) -> list[list[object]]:
    """Rows for :func:`parallel_lib.common.tables.markdown_table`: model, ranks, FSDP2's rank-0 elements,
    the padded formula, ``Ψ / N``, and FSDP2 over ``Ψ / N``."""
    rows: list[list[object]] = []
    for name, shape in shapes.items():
        psi = sum(int(torch.Size(s).numel()) for s in shape.parameter_shapes())
        for n in world_sizes:
            measured = fsdp_local_numel(shape, n)
            rows.append([name, n, f"{measured:,}", f"{fsdp_shard_numel(shape.parameter_shapes(), n):,}",
                         f"{psi / n:,.0f}", f"{measured / (psi / n):.3f}"])
    return rows
