"""A memory dry run at real scale: PyTorch's own FSDP2 and DTensor over a fake process group, on the meta device.

The planner's memory formulas are checked on this machine against a tiny model's tensor census;
at 1,024 ranks of a 1.5 B or 70 B model nothing can be run here. PyTorch can still *shard* such a
model without memory or peers: the model is built on the meta device (shapes, no storage), a
``"fake"`` process group (``torch.testing``'s ``FakeStore``) stands for ``world_size`` ranks in this one
process, and PyTorch's own parallelisms lay out each rank's shards exactly as they would on GPUs:

1. tensor parallelism over the inner ``tp`` axis of a ``dp × tp`` device mesh (``parallelize_module``
   with :func:`tp_plan`: attention's q/k/v and the MLP's gate/up column-wise, so split by heads and
   by grouped-query attention's key/value heads; the output and down projections row-wise; the token
   embedding and the head by vocabulary rows; the norms whole, as the planner assumes);
2. FSDP2 (``fully_shard``, ZeRO-3) over the outer ``dp`` axis, every block and then the root: the
   two-dimensional recipe of PyTorch's tensor-parallel tutorial and torchtitan.

Every parameter's ``to_local()`` then has the size that rank would hold. FSDP2 pads each tensor's
first dimension to ``dp`` equal chunks, which :func:`parallel_lib.cost.zero.fsdp_shard_numel` predicts
and ``Ψ / N`` misses (GPT-2 XL at 1,024 ranks: 1.22 × ``Ψ / N``); the planner's model state
(:func:`parallel_lib.planner.layout.state_memory`) must agree with it within 1 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist
from torch import nn

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.cost.units import MiB
from parallel_lib.planner.layout import Layout, state_memory
from parallel_lib.sharding.layers import layer_modules
from parallel_lib.cost.shape import LLAMA3, SHAPES, GPTShape

__all__ = ["GPT2_XL", "DRY_RUN_MODELS", "meta_model", "tp_plan", "fsdp_local_numel", "DryRun", "dry_run",
           "dry_run_rows", "DRY_RUN_HEADER"]

FP32 = 4  # bytes per element of the meta model's parameters (PyTorch's default dtype)
GPT2_XL = SHAPES["gpt2-xl (1.5B)"]  # Radford et al. 2019, table 2 (1,557,611,200 parameters, tied head)
DRY_RUN_MODELS = {"GPT-2 XL": GPT2_XL, "Llama 3 8B": LLAMA3["8B"], "Llama 3 70B": LLAMA3["70B"]}


def _is_gpt2(shape: GPTShape) -> bool:
    return shape.bias and not shape.rms_norm


def meta_model(shape: GPTShape) -> nn.Module:
    """Hugging Face's model of ``shape`` on the meta device: ``GPT2LMHeadModel``, or ``LlamaForCausalLM``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        if _is_gpt2(shape):
            return GPT2LMHeadModel(GPT2Config(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                                              vocab_size=shape.vocab_size, n_positions=shape.n_positions,
                                              n_inner=shape.ffn_hidden or None))
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=shape.n_embd, intermediate_size=shape.ffn, num_hidden_layers=shape.n_layer,
            num_attention_heads=shape.n_head, num_key_value_heads=shape.kv_heads or shape.n_head,
            vocab_size=shape.vocab_size, max_position_embeddings=shape.n_positions,
            tie_word_embeddings=shape.tied_head))


def tp_plan(shape: GPTShape) -> dict[str, object]:
    """``parallelize_module``'s plan for :func:`meta_model`'s Llama: which module is split how.

    Column-wise (``nn.Linear``'s output rows): q/k/v by (key/value) heads, the MLP's gate and up,
    the untied head by vocabulary; row-wise: the attention output and the MLP's down (input
    columns), and the token embedding (``RowwiseParallel`` on an ``nn.Embedding`` splits its
    vocabulary rows: Megatron's vocabulary-parallel embedding). Norms are left whole.

    Raises:
        ValueError: a GPT-2 shape: its ``Conv1D`` layers (a fused q/k/v stored (in, out)) are not what
            ``ColwiseParallel`` splits (it takes ``nn.Linear`` and ``nn.Embedding``).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if _is_gpt2(shape):
        raise ValueError("tp_plan covers Llama's nn.Linear layers; GPT-2's Conv1D layers (fused q/k/v, stored "
                         "(in, out)) are not split by ColwiseParallel: dry-run GPT-2 with tp=1")
    layer = "model.layers.*."
    plan: dict[str, object] = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    plan.update({layer + f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
    plan[layer + "self_attn.o_proj"] = RowwiseParallel()
    plan.update({layer + f"mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")})
    plan[layer + "mlp.down_proj"] = RowwiseParallel()
    if not shape.tied_head:
        plan["lm_head"] = ColwiseParallel()
    return plan


def fsdp_local_numel(shape: GPTShape, world_size: int, rank: int = 0, tp: int = 1) -> int:
    """Elements ``rank`` holds after tensor parallelism over ``tp`` and FSDP2 over ``world_size / tp`` ranks.

    The mesh is ``(dp, tp)`` with ``tp`` inside (consecutive ranks share a layer's shards, as a node's
    GPUs do); with ``tp == 1`` only ``fully_shard`` runs, of every block and then the root.

    Raises:
        RuntimeError: a process group already exists in this process (the dry run needs its own).
        ValueError: ``world_size < 1``, ``rank`` outside ``0..world_size-1``, ``tp`` that does not divide
            ``world_size`` or the heads, key/value heads and vocabulary, or ``tp > 1`` for a GPT-2 shape.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n = positive_int("world_size", world_size)
    check_int("rank", rank, 0, n - 1)
    if n % positive_int("tp", tp):
        raise ValueError(f"tp={tp} must divide world_size={n} (the mesh is dp × tp)")
    shape.check_tp(tp)
    plan = tp_plan(shape) if tp > 1 else {}
    if dist.is_initialized():
        raise RuntimeError("the dry run starts its own fake process group: call it where none is initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    try:
        mesh = init_device_mesh("cpu", (n // tp, tp), mesh_dim_names=("dp", "tp"))
        model = meta_model(shape)
        if tp > 1:
            parallelize_module(model, mesh["tp"], plan)
        for block in layer_modules(model):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return sum(p.to_local().numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class DryRun:
    """One model at one ``dp × tp`` layout: what rank 0 holds by PyTorch and by the planner (or why skipped)."""

    model: str
    world_size: int
    tp: int
    numel: int = 0            # rank 0's parameter elements after DTensor's TP and FSDP2 (padded: the most)
    psi: int = 0              # the model's parameters
    planner_bytes: float = 0  # the planner's parameter bytes per GPU for Layout(dp, tp, zero=3) in fp32
    skipped: str = ""         # why this tp does not apply to this model

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def measured_bytes(self) -> int:
        return self.numel * FP32

    @property
    def ratio(self) -> float:
        """Measured bytes over the planner's: within 1 % of 1 (NaN for a skipped layout)."""
        return self.measured_bytes / self.planner_bytes if self.planner_bytes else math.nan


def dry_run(shapes: dict[str, GPTShape], world_sizes: Sequence[int] = (8, 64, 256, 1024),
            tps: Sequence[int] = (1,)) -> list[DryRun]:
    """Every model at every world size and tensor-parallel size: rank 0's shards beside the planner's.

    A ``tp`` the model cannot take (it does not divide the heads, the key/value heads or the
    vocabulary, or the model is GPT-2's, see :func:`tp_plan`) gives a row with the reason.

    Raises:
        ValueError: a world size that is not a multiple of a ``tp``.
    """
    runs = []
    for name, shape in shapes.items():
        psi = sum(math.prod(s) for s in shape.parameter_shapes())
        for n in world_sizes:
            for tp in tps:
                if positive_int("world_size", n) % positive_int("tp", tp):
                    raise ValueError(f"tp={tp} must divide world_size={n} (the mesh is dp × tp)")
                try:
                    shape.check_tp(tp)
                    if tp > 1:
                        tp_plan(shape)
                except ValueError as error:
                    runs.append(DryRun(name, n, tp, psi=psi, skipped=str(error)))
                    continue
                planner = state_memory(shape, Layout(dp=n // tp, tp=tp, zero=3, dtype="fp32"))[0]["params"]
                runs.append(DryRun(name, n, tp, fsdp_local_numel(shape, n, tp=tp), psi, planner))
    return runs


DRY_RUN_HEADER = ["model", "GPUs", "dp × tp", "rank 0's elements (FSDP2 + DTensor)", "× Ψ/N", "measured MiB",
                  "planner's MiB", "measured / planner"]


def dry_run_rows(runs: Sequence[DryRun]) -> list[list[object]]:
    """:func:`dry_run`'s runs as rows under :data:`DRY_RUN_HEADER` (for ``common.tables.markdown_table``).

    Rank 0's parameter elements, their ratio to ``Ψ / N`` (FSDP2's padding, and the norms every tp rank
    keeps whole), its fp32 bytes in MiB beside the planner's, and their ratio; a skipped layout, why.
    """
    rows: list[list[object]] = []
    for run in runs:
        layout = f"{run.dp} × {run.tp}"
        if run.skipped:
            rows.append([run.model, run.world_size, layout, f"skipped: {run.skipped}", "", "", "", ""])
            continue
        rows.append([run.model, run.world_size, layout, f"{run.numel:,}",
                     f"{run.numel / (run.psi / run.world_size):.3f}", f"{run.measured_bytes / MiB:,.2f}",
                     f"{run.planner_bytes / MiB:,.2f}", f"{run.ratio:.4f}"])
    return rows
