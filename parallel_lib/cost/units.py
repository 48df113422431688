"""The course's units, stated once: memory in GiB, traffic and link speeds in GB.

- **Memory** (a tensor, a rank's state, a card) is counted in bytes and shown in GiB, 2**30 bytes.
  A GPU's memory is binary too, whatever its datasheet's "GB" says: HBM stacks hold a power of two
  of bytes, so an "A100 80GB" reports 81,920 MiB = 80 GiB through NVML (``nvidia-smi``) and an
  "H100 80GB" 81,559 MiB = 79.65 GiB (a little is reserved), not 80·10⁹ bytes = 74.5 GiB (Modal,
  "Why does an NVIDIA H100 80GB card offer 85.52 GB?", which lists NVML's figures for each card).
- **Traffic and bandwidth** (bytes on a wire, bytes per second of a link) are in GB, 10**9 bytes,
  as network and NVLink datasheets state them (400 Gb/s NDR InfiniBand = 50 GB/s).

So "35.9 GiB per GPU" is memory and "0.55 GB sent per GPU and step" is traffic.
"""

from __future__ import annotations

__all__ = ["KiB", "MiB", "GiB", "GB"]

KiB = 2**10
MiB = 2**20
GiB = 2**30  # memory: tensors, states, cards
GB = 10**9   # traffic and link bandwidth
