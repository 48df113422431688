"""Published GPU and interconnect figures, labelled as published: what a calibration would measure on them.

These are datasheet peaks (dense, no sparsity), not measurements: a real training step reaches
roughly 40–55 % of the FLOP/s (Narayanan et al. 2021, table 1, p. 8: 43–52 % on A100s, 47 % for the
145.6 B GPT, 52 % only for the 530 B and 1 T models; the Llama 3 paper, table 4, p. 10: 38–43 % on
H100s) and a collective less than the link's peak.
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

Which link a group crosses (:class:`Links`, :func:`group_span`): a node holds ``gpus_per_node``
consecutive ranks, and the mesh's axis order (:data:`~parallel_lib.runtime.mesh.DEFAULT_ORDER`,
tp fastest) decides which ranks a group holds. A tp group of 8 is 8 consecutive ranks, one node,
NVLink; a dp group's ranks lie ``tp · cp · pp`` apart, so it stays inside a node only while
``tp · cp · pp · dp`` ranks do, and otherwise its ring runs at the network's speed (a ring is as fast
as its slowest link; with one adapter per GPU every GPU of the ring sends on its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.cost.units import GiB, MiB
from parallel_lib.planner.calibrate import KINDS, AlphaBeta, Calibration, RankSpeed
from parallel_lib.runtime.mesh import DEFAULT_ORDER

__all__ = ["GPU", "GPUS", "Links", "group_span", "published_calibration", "published_table"]


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
    return Links.of(gpu, gpus_per_node).calibration()


def published_table() -> list[list[object]]:
    """Rows for :func:`parallel_lib.common.tables.markdown_table`: every GPU's published figures."""
    return [[g.name, f"{g.flops_bf16 / 1e12:.0f}", f"{g.hbm_bandwidth / 1e12:.2f}", f"{g.memory_gib:.2f}",
             f"{g.nvlink / 1e9:.0f}", f"{g.network / 1e9:.2f}", g.source] for g in GPUS.values()]


@dataclass(frozen=True)
class Links:
    """The two links a group's collectives may cross, in bytes/s per GPU and direction.

    ``inside``: between the ``gpus_per_node`` GPUs of one node (NVLink); ``across``: between nodes (the
    network, one adapter per GPU). A group ``span`` consecutive ranks wide (:func:`group_span`) stays
    inside one node when ``span <= gpus_per_node``; wider, its ring runs at the network's speed.

    Raises:
        ValueError: a bandwidth that is not a number > 0, or ``gpus_per_node`` not an int >= 1.
    """

    inside: float
    across: float
    gpus_per_node: int = 8
    inside_name: str = "NVLink"
    across_name: str = "InfiniBand"
    gpu: str = "H100"                # whose published compute rate :meth:`calibration` uses

    def __post_init__(self) -> None:
        positive_number("inside", self.inside, hint="bytes per second inside a node, e.g. 450e9 (NVLink 4)")
        positive_number("across", self.across, hint="bytes per second per GPU across nodes, e.g. 50e9 (NDR)")
        positive_int("gpus_per_node", self.gpus_per_node, hint="GPUs that share NVLink in one node")
        check_choice("gpu", self.gpu, sorted(GPUS))

    @classmethod
    def of(cls, gpu: str, gpus_per_node: int = 8) -> "Links":
        """A node of ``gpus_per_node`` published GPUs (:data:`GPUS`): NVLink inside, InfiniBand across.

        Raises:
            ValueError: an unknown ``gpu``.
        """
        g = GPUS[check_choice("gpu", gpu, sorted(GPUS))]
        return cls(g.nvlink, g.network, gpus_per_node, gpu=gpu)

    def calibration(self) -> Calibration:
        """These links as a :class:`~parallel_lib.planner.calibrate.Calibration` of published figures.

        Groups within ``gpus_per_node`` consecutive ranks run at ``inside`` with NVLink's latency per ring
        step, wider ones at ``across`` with the network's; every GPU computes at ``gpu``'s published peak.
        This is what :func:`published_calibration` returns for a DGX node, and what chapter 05's planner
        prices its named strategies with (:func:`parallel_lib.planner.layout.price`).
        """
        g = GPUS[self.gpu]
        inside, across = AlphaBeta(NVLINK_LATENCY, self.inside), AlphaBeta(NETWORK_LATENCY, self.across)
        ranks = {1: RankSpeed(1, g.flops_bf16, g.hbm_bandwidth, {kind: inside for kind in KINDS})}
        return Calibration(f"published peaks of {g.name}" + ("" if self == Links.of(self.gpu, self.gpus_per_node)
                                                             else f" on {self}"),
                           ranks, self.gpus_per_node, {kind: across for kind in KINDS})

    def crosses_nodes(self, span: int) -> bool:
        """Whether a group ``span`` consecutive ranks wide reaches beyond one node."""
        return positive_int("span", span) > self.gpus_per_node

    def bandwidth(self, span: int) -> float:
        """Bytes/s per GPU of a group ``span`` consecutive ranks wide: the network's once it crosses nodes."""
        return self.across if self.crosses_nodes(span) else self.inside

    def describe(self, span: int) -> str:
        """The link a group ``span`` ranks wide runs on, for a sentence: ``"NVLink, 450 GB/s"``."""
        name = self.across_name if self.crosses_nodes(span) else self.inside_name
        return f"{name}, {self.bandwidth(span) / 1e9:g} GB/s"

    def __str__(self) -> str:
        return (f"{self.inside_name} {self.inside / 1e9:g} GB/s inside nodes of {self.gpus_per_node}, "
                f"{self.across_name} {self.across / 1e9:g} GB/s across")


def group_span(axis: str, sizes: Mapping[str, int], order: str = DEFAULT_ORDER) -> int:
    """Consecutive ranks one ``axis`` group reaches: its size times the sizes of every faster axis in ``order``.

    With ``order`` fastest-first (the runtime's ``"tp-cp-ep-pp-dp"``), a tp group is ``tp`` ranks wide and a
    dp group ``tp · cp · ep · pp · dp`` (its ranks lie ``tp · cp · ep · pp`` apart). Axes missing from ``sizes``
    have size 1.

    Raises:
        ValueError: ``axis`` not in ``order``, or a size that is not an int >= 1.
    """
    names = order.split("-")
    check_choice("axis", axis, names)
    span = 1
    for name in names:
        span *= positive_int(f"sizes[{name!r}]", sizes.get(name, 1))
        if name == axis:
            break
    return span
