"""Dropout whose mask depends only on (seed, replica, forward call, site) and is drawn on the activation's device.

Two reasons not to use ``nn.Dropout``:

- **Parallel runs must drop what one process drops.** Under tensor parallelism a rank holds
  some heads, or (sequence parallelism) some tokens, of an activation. Each site here draws
  the mask of the *whole* tensor from a generator seeded by (seed, call, site) and keeps the
  slice its input is (:attr:`SeededDropout.dim`, ``index``, ``parts``, set by the
  parallelism that split it), so any split drops exactly the elements one process drops.
  Megatron-LM instead gives every rank its own random stream inside split regions: cheaper,
  not comparable bit for bit.
- **Data-parallel replicas drop differently.** Each replica trains on its own rows, so it needs
  its own masks: the stream's ``replica`` (set by the one training entry to the rank's data-parallel
  index) is part of the seed. Replica 0 draws what a stream without replicas draws; one process
  stands for ``dp`` replicas by running each replica's rows with that replica's stream
  (:func:`parallel_lib.training.reference`).
- **The mask is drawn where the activation lives.** The generator is created on the
  activation's device (``torch.Generator(device=x.device)``), so a GPU never waits for a CPU
  to draw a (batch, heads, s, s) mask and copy it over.

The random numbers depend on the device type (CPU and CUDA generators differ), so equality
holds between runs on the same kind of device, which is what every proof compares.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel_lib.common.checks import check_int, check_number

__all__ = ["DropoutStream", "SeededDropout"]

_MASK64 = (1 << 64) - 1


class DropoutStream:
    """A model's dropout seed, data-parallel replica and forward-call counter, shared by all its sites.

    Args:
        seed: the seed of every mask.
        replica: the data-parallel replica this model trains in (0: the only one).

    Raises:
        ValueError: ``seed`` is not an int (2.7 would have dropped as 2), or ``replica`` not an int >= 0.
    """

    def __init__(self, seed: int = 0, replica: int = 0) -> None:
        self.seed, self.calls = check_int("seed", seed), 0
        self.replica = check_int("replica", replica, minimum=0)

    def start_forward(self) -> None:
        """Count one more forward pass: every site then draws a fresh mask."""
        self.calls += 1

    def key(self, site: int) -> int:
        """The generator seed of ``site`` in the current forward pass.

        Replica 0's key is the one a stream had before replicas (every stored run draws it); another
        replica's is that key hashed with the replica (a CPU generator keeps only a seed's low 32 bits,
        so adding a large multiple of the replica would change nothing there).
        """
        key = self.seed * 1_000_003 + self.calls * 10_007 + site
        return key if self.replica == 0 else _mix(_mix(key) + self.replica)

    def __repr__(self) -> str:
        replica = f", replica={self.replica}" if self.replica else ""
        return f"DropoutStream(seed={self.seed}{replica}, calls={self.calls})"


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints whose every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SeededDropout(nn.Module):
    """Dropout with probability ``p`` at one numbered ``site`` of a model (see the module docstring).

    Args:
        p: the probability of dropping an element, in [0, 1).
        stream: the model's :class:`DropoutStream`.
        site: this site's number, unique in the model.

    Attributes:
        dim, index, parts: the input is slice ``index`` of ``parts`` equal slices along ``dim`` of
            the tensor one process would see (``parts == 1``: the whole tensor).

    Raises:
        ValueError: ``p`` outside [0, 1).
    """

    def __init__(self, p: float, stream: DropoutStream, site: int) -> None:
        super().__init__()
        check_number("p", p, 0.0)
        if p >= 1.0:
            raise ValueError(f"dropout p must be below 1, got p={p}; p=1 would drop everything")
        self.p, self.stream, self.site = float(p), stream, site
        self.dim, self.index, self.parts = 1, 0, 1

    def split(self, dim: int, index: int, parts: int) -> None:
        """Say that the input is slice ``index`` of ``parts`` along ``dim`` (set by a parallelism)."""
        self.dim, self.index, self.parts = dim, index, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        generator = torch.Generator(device=x.device).manual_seed(self.stream.key(self.site))
        whole = list(x.shape)
        whole[self.dim] *= self.parts
        draw = torch.rand(whole, generator=generator, device=x.device)  # fp32 whatever x's dtype: the same mask
        keep = draw.narrow(self.dim, self.index * x.shape[self.dim], x.shape[self.dim]) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        split = f", slice {self.index} of {self.parts} along dim {self.dim}" if self.parts > 1 else ""
        return f"p={self.p}, site={self.site}{split}"
