"""PyTorch's own data parallelism and sharding as choices of the dp axis (``Plan.sync``), beside ZeRO's engine.

Chapter 06 compares its :class:`~parallel_lib.sharding.zero.ZeroEngine` with what PyTorch ships, on
the same batches and the same one-process reference:

- ``"ddp"``: ``DistributedDataParallel`` (its bucketed all-reduce during backward) and AdamW;
- ``"zero_redundancy"``: DDP and ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1:
  each rank updates its part of the parameters and broadcasts it);
- ``"fsdp2"``: ``torch.distributed.fsdp.fully_shard`` on every block and on the stage (ZeRO-3).

Each is built as :mod:`.data_axis` says (``(plan, run, stage, pm) -> (module, axis)``) and
offers the axis's calls; ``census()`` counts what the rank holds (parameters, gradients,
optimizer states). ``"zero_redundancy"`` and ``"fsdp2"`` shard a whole model over dp only
(:data:`WHOLE_MODEL`: ``Plan.check`` refuses them with tp or pp > 1).

DDP's all-reduce runs in C++, where the collective counter cannot see it: a comm hook issues
the same all-reduce through ``torch.distributed`` so that it is counted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import RankMesh
from parallel_lib.sharding.memory import optimizer_tensors, storage_census
from parallel_lib.training.averagers import make_optimizer

__all__ = ["WHOLE_MODEL", "TorchAxis", "ddp_axis", "zero_redundancy_axis", "fsdp2_axis"]

WHOLE_MODEL = ("zero_redundancy", "fsdp2")  # syncs that need tp = pp = 1


class TorchAxis:
    """The dp axis's calls over a PyTorch optimizer; gradients are reduced by the wrapper during backward."""

    def __init__(self, stage: nn.Module, optimizer: torch.optim.Optimizer, owned: list[torch.Tensor]) -> None:
        self.stage, self.optimizer, self.master = stage, optimizer, owned

    @property
    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.stage.parameters() if p.requires_grad]

    def reduce_gradients(self) -> None:
        """Nothing left to do: DDP averaged and FSDP2 reduce-scattered the gradients in backward."""

    def reduced_gradient(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s averaged gradient (this rank's shard of it under FSDP2)."""
        grad = param.grad
        return grad.to_local() if hasattr(grad, "to_local") else grad

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's own clip: the gradients are the averaged ones (FSDP2's DTensors add their shards' norms)."""
        norm = torch.nn.utils.clip_grad_norm_(self._trainable, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def census(self) -> dict[str, int]:
        """Bytes of the stage's parameters, their gradients and the optimizer's states on this rank."""
        params = list(self.stage.parameters())
        optimizer = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: its shard's AdamW
        return storage_census(params, [p.grad for p in params], optimizer_tensors(optimizer))

    def remove(self) -> None:
        """The full parameters back in the stage as plain ones (FSDP2 gathers its shards; DDP's are full already).

        A collective under FSDP2: call it on every rank of the dp axis.
        """
        plain: dict[int, nn.Parameter] = {}  # a tied parameter is one DTensor under several names: one copy
        for module in self.stage.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if hasattr(p, "full_tensor"):
                    if id(p) not in plain:
                        plain[id(p)] = nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
                    setattr(module, name, plain[id(p)])


def _adamw(run: Any) -> dict[str, float]:
    return dict(lr=run.lr, eps=run.eps, weight_decay=run.weight_decay)


def _counted_all_reduce(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    """DDP's default all-reduce hook (the mean over ``group``), issued through ``dist.all_reduce`` so it is counted."""
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _ddp(run: Any, stage: nn.Module, pm: RankMesh) -> nn.Module:
    device = rank_device()
    group = pm.group("dp")
    ddp = nn.parallel.DistributedDataParallel(stage, device_ids=[device.index] if device.type == "cuda" else None,
                                              process_group=group, bucket_cap_mb=run.bucket_cap_mb)
    ddp.register_comm_hook(group, _counted_all_reduce)
    return ddp


def ddp_axis(plan: Any, run: Any, stage: nn.Module, pm: RankMesh) -> tuple[nn.Module, TorchAxis]:
    """``"ddp"``: DistributedDataParallel over ``pm.group("dp")`` and ``run.optimizer`` (AdamW) on every parameter."""
    trainable = [p for p in stage.parameters() if p.requires_grad]
    return _ddp(run, stage, pm), TorchAxis(stage, make_optimizer(run, trainable), trainable)  # chapter 01: or SGD


def zero_redundancy_axis(plan: Any, run: Any, stage: nn.Module, pm: RankMesh) -> tuple[nn.Module, TorchAxis]:
    """``"zero_redundancy"``: DDP and ZeroRedundancyOptimizer (AdamW on this rank's part, then broadcasts)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    trainable = [p for p in stage.parameters() if p.requires_grad]
    module = _ddp(run, stage, pm)
    optimizer = ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, process_group=pm.group("dp"),
                                        **_adamw(run))
    owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
    return module, TorchAxis(stage, optimizer, owned)


def fsdp2_axis(plan: Any, run: Any, stage: nn.Module, pm: RankMesh) -> tuple[nn.Module, TorchAxis]:
    """``"fsdp2"``: ``fully_shard`` on every block, then on the stage (its embeddings and final norm)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = pm.group("dp")
    # named after this run's group: DTensor caches sharding decisions by mesh, and an equal mesh of an
    # earlier run in the same process would bring back that run's (destroyed) group
    mesh = DeviceMesh.from_group(group, rank_device().type, mesh_dim_names=(f"dp_{group.group_name}",))
    for block in stage.h:
        fully_shard(block, mesh=mesh)
    fully_shard(stage, mesh=mesh)
    trainable = [p for p in stage.parameters() if p.requires_grad]
    owned = [p.to_local() for p in trainable]
    return stage, TorchAxis(stage, torch.optim.AdamW(trainable, **_adamw(run)), owned)
