"""Published GPU and interconnect figures, labelled as published: what a calibration would measure on them.

These are datasheet peaks (dense, no sparsity), not measurements: a real training step reaches
roughly 40–55 % of the FLOP/s (Narayanan et al. 2021 report 52 % on A100s for GPT-3-sized
models; the Llama 3 paper, table 4, 38–43 % on H100s) and a collective less than the link's peak.
A :class:`~parallel_lib.planner.calibrate.Calibration` built from them (:func:`published_calibration`)
therefore predicts a lower bound on step time, and says so.

Sources:
- NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16/fp16 dense, 3.35 TB/s HBM3, 80 GB,
  NVLink 4 900 GB/s per GPU (both directions together).
- NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB): 312 TFLOP/s bf16/fp16, 2.04 TB/s HBM2e,
  NVLink 3 600 GB/s per GPU.
- NVIDIA V100 Tensor Core GPU datasheet (SXM2): 125 TFLOP/s fp16 tensor cores (no bf16), 900 GB/s HBM2,
  16 or 32 GB, NVLink 2 300 GB/s per GPU.
- Memory is binary (:mod:`parallel_lib.cost.units`): the "80 GB" of an A100 is 81,920 MiB = 80 GiB as
  NVML reports it, an H100's 81,559 MiB = 79.65 GiB (Modal's table of NVML figures, named there); a
  V100 32GB is taken at its nominal 32 GiB. Reading "80 GB" as 80·10⁹ bytes (74.5 GiB) made Llama 3
  405B's published layout look 0.6 GiB too big for its card.
- InfiniBand across nodes: one 400 Gb/s NDR adapter per GPU (DGX H100) is 50 GB/s per direction; one
  200 Gb/s HDR adapter per GPU (DGX A100) 25 GB/s; DGX-1 (V100) has 4 × 100 Gb/s EDR for 8 GPUs, 6.25 GB/s per GPU.
- Latency per ring step: a few microseconds inside a node (NVLink), ~10 µs across InfiniBand — an
  order of magnitude from nccl-tests' small-message times, not a datasheet figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lib.common.checks import check_choice, positive_int
from parallel_lib.cost.units import GiB, MiB
from parallel_lib.planner.calibrate import KINDS, AlphaBeta, Calibration, RankSpeed

__all__ = ["GPU", "GPUS", "published_calibration", "published_table"]


@dataclass(frozen=True)
class GPU:
    """One accelerator's published figures: memory in GiB (binary), rates in bytes/s (powers of ten)."""

    name: str
    flops_bf16: float           # dense bf16 (V100: fp16) tensor-core FLOP/s
    hbm_bandwidth: float        # bytes/s
    memory_gib: float           # GiB a program can allocate (NVML's total; the datasheet's "GB" is binary)
    nvlink: float               # bytes/s per direction, inside a node
    network: float              # bytes/s per direction per GPU, across nodes
    source: str

    @property
    def memory_bytes(self) -> float:
        """The card's memory in bytes."""
        return self.memory_gib * GiB

    @property
    def memory_gb(self) -> float:
        """The card's memory in 10**9 bytes (85.5 for an H100 80GB): ``memory_gb * 1e9`` is its bytes."""
        return self.memory_bytes / 1e9


GPUS: dict[str, GPU] = {
    "H100": GPU("H100 SXM5 80GB", 989e12, 3.35e12, 81_559 * MiB / GiB, 450e9, 50e9,
                "NVIDIA H100 datasheet; DGX H100: 8 x 400 Gb/s NDR InfiniBand"),
    "A100": GPU("A100 SXM4 80GB", 312e12, 2.039e12, 80, 300e9, 25e9,
                "NVIDIA A100 datasheet; DGX A100: 8 x 200 Gb/s HDR InfiniBand"),
    "V100": GPU("V100 SXM2 32GB", 125e12, 0.9e12, 32, 150e9, 6.25e9,
                "NVIDIA V100 datasheet (fp16; no bf16); DGX-1: 4 x 100 Gb/s EDR InfiniBand for 8 GPUs"),
}
NVLINK_LATENCY, NETWORK_LATENCY = 5e-6, 10e-6  # seconds per ring step, an order of magnitude (module docstring)


def published_calibration(gpu: str, gpus_per_node: int = 8) -> Calibration:
    """A calibration from published peaks: collectives inside ``gpus_per_node`` over NVLink, beyond over the network.

    A group whose ranks span more than ``gpus_per_node`` consecutive ranks crosses nodes and runs at the
    network's speed (a ring is as fast as its slowest link); every GPU computes at its own peak.

    Raises:
        ValueError: an unknown ``gpu``, or ``gpus_per_node`` not an int >= 1 (0 would put every GPU on NVLink).
    """
    g = GPUS[check_choice("gpu", gpu, sorted(GPUS))]
    positive_int("gpus_per_node", gpus_per_node, hint="GPUs that share NVLink in one node")
    inside = AlphaBeta(NVLINK_LATENCY, g.nvlink)
    across = AlphaBeta(NETWORK_LATENCY, g.network)
    ranks = {1: RankSpeed(1, g.flops_bf16, g.hbm_bandwidth, {kind: inside for kind in KINDS})}
    return Calibration(f"published peaks of {g.name}", ranks, gpus_per_node, {kind: across for kind in KINDS})


def published_table() -> list[list[object]]:
    """Rows for :func:`parallel_lib.common.tables.markdown_table`: every GPU's published figures."""
    return [[g.name, f"{g.flops_bf16 / 1e12:.0f}", f"{g.hbm_bandwidth / 1e12:.2f}", f"{g.memory_gib:.2f}",
             f"{g.nvlink / 1e9:.0f}", f"{g.network / 1e9:.2f}", g.source] for g in GPUS.values()]
