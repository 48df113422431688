"""Flat-parameter shards: many parameters in one padded buffer, each rank owning a contiguous slice.

ZeRO never shards a parameter tensor by itself: it concatenates the parameters of a
bucket (stages 1-2) or a layer group (stage 3) into ONE flat buffer, pads it to a
multiple of the world size N, and gives rank r elements ``[r*c, (r+1)*c)`` with
``c = padded / N``. Reduce-scatter and all-gather then move one tensor per group,
whatever the number of parameters in it, and each rank's shard is a plain tensor
an optimizer can update.

    flat buffer of a group, 10 elements, N = 4 ranks -> padded to 12, c = 3

      | w (2x3): 0..5 | b (4): 6..9 | pad: 10,11 |
      |  rank 0  |  rank 1  |  rank 2  |  rank 3  |
         0 1 2      3 4 5      6 7 8      9 10 11

The module's parameters become views into the buffer (``param.data = flat[a:b].view(shape)``),
so the model computes with the buffer's values and an update of the buffer is an update
of the model. Stage 3 frees the full buffer between uses: its storage is resized to zero
bytes and grown back before the next all-gather; the views, and the tensors autograd saved
from them, point at the same storage again once it is refilled (PyTorch's FSDP1 did the same).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from parallel_lib.common.checks import check_int, positive_int

__all__ = ["padded_numel", "shard_owner", "FlatParamGroup"]


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (every shard the same size)."""
    check_int("numel", numel, minimum=0)
    positive_int("world_size", world_size)
    return -(-numel // world_size) * world_size


def shard_owner(index: int, numel: int, world_size: int) -> int:
    """The rank whose shard holds element ``index`` of a flat buffer of ``numel`` real elements.

    Raises:
        ValueError: ``index`` outside ``[0, numel)`` (padding belongs to nobody's parameters).
    """
    check_int("index", index, minimum=0, maximum=numel - 1,
              hint="padding elements hold no parameter" if index >= numel > 0 else "")
    return index // (padded_numel(numel, world_size) // world_size)


class FlatParamGroup:
    """The parameters of one bucket or layer group in one flat buffer, padded to a multiple of N.

    Args:
        params: distinct parameters of one dtype and device (a tied parameter appears once).
        world_size: number of ranks N sharing the buffer.
        rank: this rank; its shard is ``full[rank*c:(rank+1)*c]``.
        name: for messages ("block 3", "bucket 0").

    Attributes:
        full: the padded flat buffer (its storage is empty while a stage-3 group is freed).
        shard: this rank's slice; a view of ``full`` until :meth:`own_shard` makes it a tensor of its own.
        numel, padded, shard_numel: real elements, padded elements, elements per shard.
    """

    def __init__(self, params: Sequence[nn.Parameter], world_size: int, rank: int, name: str = "") -> None:
        if not params:
            raise ValueError(f"group {name!r} has no parameters")
        if len({(p.dtype, p.device) for p in params}) > 1 or len({id(p) for p in params}) < len(params):
            raise ValueError(f"group {name!r} needs distinct parameters of one dtype and device")
        self.name, self.world_size = name, positive_int("world_size", world_size)
        self.rank = check_int("rank", rank, minimum=0, maximum=world_size - 1)
        self.params = list(params)
        self.shapes = [p.shape for p in params]
        sizes = [p.numel() for p in params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        self.padded = padded_numel(self.numel, world_size)
        self.shard_numel = self.padded // world_size
        self.full = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                self.full[offset:offset + p.numel()].copy_(p.reshape(-1))
        self.shard = self.full[rank * self.shard_numel:(rank + 1) * self.shard_numel]
        self._point_params()

    def _point_params(self) -> None:
        """Make every parameter a view of its slice of ``full``."""
        for p, offset, shape in zip(self.params, self.offsets, self.shapes):
            p.data = self.full[offset:offset + shape.numel()].view(shape)

    def cast(self, dtype: torch.dtype) -> None:
        """Hold the buffer (and so the parameters) in ``dtype``, e.g. bf16 for mixed precision."""
        shard_is_view = self.shard.untyped_storage().data_ptr() == self.full.untyped_storage().data_ptr()
        self.full = self.full.to(dtype)
        self.shard = (self.full[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
                      if shard_is_view else self.shard.to(dtype))
        self._point_params()

    def own_shard(self) -> None:
        """Give the shard a storage of its own (stage 3), so that ``full`` can be freed."""
        self.shard = self.shard.clone()

    @property
    def gathered(self) -> bool:
        """Whether ``full`` currently holds memory (always, except for a freed stage-3 group)."""
        return self.full.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        """Grow the freed buffer back (its values are garbage until an all-gather fills it)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())

    def free(self) -> None:
        """Drop the full buffer's memory; the parameters keep their shapes but hold no data."""
        self.full.untyped_storage().resize_(0)

    def pack_grads(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The parameters' gradients in one padded flat tensor (zeros where a gradient is None)."""
        buffer = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device) if out is None else out
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                buffer[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        return buffer

    def check_unchanged(self, model_params: set[int]) -> None:
        """Raise if a parameter was replaced, reshaped, re-pointed or removed since sharding."""
        base = self.full.untyped_storage().data_ptr()
        for p, offset, shape in zip(self.params, self.offsets, self.shapes):
            name = getattr(p, "_zero_name", "?")
            if id(p) not in model_params or p.shape != shape or p.untyped_storage().data_ptr() != base \
                    or p.storage_offset() != offset:
                raise RuntimeError(f"parameter {name!r} of {self.name} changed after sharding (replaced, "
                                   f"resized or given new data); build a new ZeroEngine for the changed model")
