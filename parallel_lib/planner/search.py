"""The calibrated planner's search: every dp × tp × pp (× cp) layout of a job, priced, ranked, misfits explained.

:func:`plan_layouts` answers the practitioner's question before a launch — which layout, how much
memory, how fast — for a GPT-shaped model (:class:`~parallel_lib.tensor_parallel.cost.GPTShape`)
on ``devices`` of ``memory_per_device`` bytes. It tries every factorisation ``dp · tp · pp = devices``
(tp dividing the heads and within a node, pp at most the blocks; with ``context_parallel`` also
``dp · tp · pp · cp = devices`` for each cp given), every ZeRO stage, sequence
parallelism with tp, the pipeline schedules, and recomputation, and prices each with
:func:`parallel_lib.planner.layout.price`. The layouts that fit are ranked by predicted step time
(ties: less memory); each one that does not fit keeps the sentence that says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from parallel_lib.common.checks import positive_int
from parallel_lib.cost.units import GiB, MiB
from parallel_lib.inference.serving_memory import check_memory_bytes
from parallel_lib.planner.calibrate import Calibration
from parallel_lib.planner.layout import Layout, Priced, StepCost, price
from parallel_lib.cost.shape import GPTShape

__all__ = ["Candidate", "LayoutPlan", "plan_layouts", "divisors"]


@dataclass(frozen=True)
class Candidate:
    """A priced layout and, when it does not fit (or cannot run), why."""

    priced: Optional[Priced]
    layout: Layout
    why_not: str = ""

    @property
    def fits(self) -> bool:
        return not self.why_not


@dataclass(frozen=True)
class LayoutPlan:
    """Every layout tried: ``ranked`` fit, fastest first; ``rejected`` do not, each with its reason."""

    ranked: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]
    memory_per_device: float

    @property
    def best(self) -> Optional[Candidate]:
        return self.ranked[0] if self.ranked else None

    def table(self, top: int = 10) -> list[list[object]]:
        """Rows for :func:`parallel_lib.common.tables.markdown_table`: layout, memory GiB, step s."""
        return [[c.layout.name, f"{c.priced.memory_bytes / GiB:.2f}", f"{c.priced.step_seconds:.3g}",
                 f"{c.priced.bubble:.0%}"] for c in self.ranked[:top] if c.priced]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(rows: int, pp: int, cap: int) -> int:
    """A pipeline's micro-batch count: the most that divides the replica's rows, at most ``cap · pp``."""
    return max(m for m in divisors(rows) if m <= max(1, cap * pp)) if pp > 1 else 1


def plan_layouts(shape: GPTShape, devices: int, memory_per_device: float, global_batch: int, seq_len: int,
                 calibration: Calibration, step_cost: Union[StepCost, str], dtype: str = "bf16",
                 gpus_per_node: int = 8, schedules: Sequence[str] = ("1f1b", "interleaved", "zb-h1"),
                 zero_stages: Sequence[int] = (0, 1, 2, 3), recompute: Sequence[bool] = (False, True),
                 max_pp: int = 32, micro_batch_cap: int = 4, attention_scores: bool = False,
                 context_parallel: Sequence[int] = (1,), overlap: Optional[bool] = None) -> LayoutPlan:
    """Price every layout of ``shape`` on ``devices`` devices; rank those within ``memory_per_device`` bytes.

    Pipelines run as many micro-batches as divide the replica's sequences, at most ``micro_batch_cap · pp``
    (the bubble shrinks with m; the GPipe paper's rule of thumb is m ≥ 4p); without a pipeline the
    replica's batch is split into the fewest micro-batches (gradient accumulation) whose activations fit.
    ``context_parallel``: the cp sizes to try (chapter 11: each sequence split over cp ranks); a cp
    that does not divide the devices, or whose 2·cp does not divide the sequence, is skipped.
    ``overlap``: hide data-parallel communication behind compute (:func:`~parallel_lib.planner.layout.price`;
    None: as the calibration's engines do).

    Raises:
        ValueError: a non-positive size (devices, batch, sequence, ``gpus_per_node``, ``max_pp``,
            ``micro_batch_cap``, the shape's layers, heads, width or vocabulary), a sequence longer than
            the shape's ``n_positions``, or ``memory_per_device`` that looks like GiB rather than bytes.
    """
    positive_int("devices", devices)
    positive_int("global_batch", global_batch)
    positive_int("seq_len", seq_len)
    positive_int("gpus_per_node", gpus_per_node)
    positive_int("max_pp", max_pp, hint="1 means no pipeline")
    positive_int("micro_batch_cap", micro_batch_cap)
    for name in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        positive_int(f"shape.{name}", getattr(shape, name), hint="a model needs at least one of each")
    if seq_len > shape.n_positions:
        raise ValueError(f"seq_len={seq_len} is longer than the model's n_positions={shape.n_positions}; "
                         "shorten the sequence or give the shape more positions")
    check_memory_bytes("memory_per_device", memory_per_device)
    fits: list[Candidate] = []
    rejected: list[Candidate] = []
    for cp in context_parallel:
        if devices % positive_int("cp", cp) == 0 and seq_len % (2 * cp if cp > 1 else 1) == 0:
            _grid(fits, rejected, cp, shape, devices, global_batch, seq_len, calibration, step_cost, dtype,
                  gpus_per_node, schedules, zero_stages, recompute, max_pp, micro_batch_cap, attention_scores,
                  memory_per_device, overlap)
    fits.sort(key=lambda c: (c.priced.step_seconds, c.priced.memory_bytes))  # type: ignore[union-attr]
    return LayoutPlan(tuple(fits), tuple(rejected), memory_per_device)


def _grid(fits: list, rejected: list, cp: int, shape: GPTShape, devices: int, global_batch: int, seq_len: int,
          calibration: Calibration, step_cost: Union[StepCost, str], dtype: str, gpus_per_node: int,
          schedules: Sequence[str], zero_stages: Sequence[int], recompute: Sequence[bool], max_pp: int,
          micro_batch_cap: int, attention_scores: bool, memory_per_device: float,
          overlap: Optional[bool] = None) -> None:
    """Every dp × tp × pp of ``devices / cp`` ranks, priced into ``fits`` or ``rejected``."""
    for tp in divisors(devices // cp):
        if tp > gpus_per_node or shape.n_head % tp or shape.vocab_size % tp:
            continue
        for pp in divisors(devices // cp // tp):
            if pp > min(shape.n_layer, max_pp):
                continue
            dp = devices // (tp * pp * cp)
            if global_batch % dp:
                rejected.append(Candidate(None, Layout(dp=dp, tp=tp, pp=pp, cp=cp),
                                          f"the batch of {global_batch} sequences does not split over dp={dp}"))
                continue
            rows = global_batch // dp
            for z in (zero_stages if dp * cp > 1 else (0,)):
                for sp in ((False, True) if tp > 1 else (False,)):
                    for name in (schedules if pp > 1 else ("1f1b",)):
                        m = _micro_batches(rows, pp, micro_batch_cap)
                        v = 2 if name == "interleaved" else 1
                        if name == "interleaved" and (m % pp or shape.n_layer < 2 * pp):
                            continue  # Megatron's order needs m a multiple of p, and two blocks per rank
                        for rc in recompute:
                            _try(fits, rejected, Layout(dp, tp, pp, z, sp, name, v, m, rc, dtype, cp=cp), shape,
                                 rows, global_batch, seq_len, calibration, step_cost, memory_per_device,
                                 attention_scores, overlap)


def _try(fits: list, rejected: list, layout: Layout, shape: GPTShape, rows: int, global_batch: int, seq_len: int,
         calibration: Calibration, step_cost: Union[StepCost, str], memory: float, scores: bool,
         overlap: Optional[bool] = None) -> None:
    """Price ``layout``; without a pipeline, accumulate over the fewest micro-batches that fit."""
    counts = divisors(rows) if layout.pp == 1 else [layout.micro_batches]
    priced = None
    for m in counts:
        candidate = replace(layout, micro_batches=m)
        priced = price(candidate, shape, global_batch, seq_len, calibration, step_cost, scores, overlap)
        if priced.memory_bytes <= memory:
            fits.append(Candidate(priced, candidate))
            return
    assert priced is not None
    # GiB for a GPU's memory, MiB for the small jobs a CPU runs: the unit of the memory given
    unit, size = ("GiB", GiB) if memory >= GiB else ("MiB", MiB)
    rejected.append(Candidate(priced, priced.layout,
                              f"{priced.state_bytes / size:.1f} {unit} of model state + "
                              + (f"{priced.working_bytes / size:.1f} {unit} gathered by ZeRO-3 + "
                                 if priced.working_bytes else "") +
                              f"{priced.activation_bytes / size:.1f} {unit} of activations ({priced.in_flight:g} "
                              "micro-batch(es) in flight) > "
                              f"{memory / size:.4g} {unit} per device"))
