"""A plan: which parallelism goes on which axis of the mesh, and how the pipeline runs.

A training run is (model builder, mesh, plan, run config). The plan names, per axis, what is
applied there, in the order :func:`~parallel_lib.training.run.train` applies it (as torchtitan's
``parallelize_llama`` does: tensor parallelism first, then the pipeline split, then data
parallelism / sharding on what each stage keeps)::

    tp   chapter 07: every block split by heads (column and row layers), the vocabulary split;
         ``sequence_parallel`` also splits the norms' and dropouts' activations by sequence
    pp   chapters 04 and 08: the blocks cut into ``pp`` stages, run by ``schedule`` over
         ``micro_batches``, with ``recompute`` keeping only each stage's input
    cp   chapter 11: every sequence cut into ``cp`` shards (``cp_layout``: "zigzag" or
         "contiguous"), attention swapped for ring attention over the ``cp`` group; every
         parameter replicated, its gradient averaged over ``dp`` and ``cp`` together
    ep   chapter 12: the mixture-of-experts MLPs' experts spread over ``ep`` ranks (the run's
         ``experts``), tokens sent to them by all-to-all; everything else replicated, each
         ep rank with rows of its own (data parallel for the rest of the model)
    dp   chapters 01 and 06: replicas over the rest of the ranks, their gradients averaged;
         ``zero`` shards optimizer state (1), gradients (2) and parameters (3) over the replicas
         (with cp or ep: over the flattened ``("dp", "cp")`` / ``("dp", "ep")`` group, the
         experts over ``dp`` alone, :mod:`.expert_axis`)

Every axis may be 1. :meth:`Plan.check` refuses, naming the field, what cannot run, before any
rank starts (the checks that need the run, such as a sequence length for cp or the number of
experts for ep, are :func:`~parallel_lib.training.run.check_layout`'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from parallel_lib.common.checks import check_choice, positive_int
from parallel_lib.context_parallel.layout import LAYOUTS
from parallel_lib.pipeline_parallel.schedule import SCHEDULES
from parallel_lib.runtime.mesh import DEFAULT_ORDER, Mesh
from parallel_lib.training.averagers import check_averager
from parallel_lib.training.data_axis import SYNCS, WHOLE_MODEL

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """What each mesh axis carries; the same on every rank."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                     # ZeRO stage over dp: 0 (plain data parallel) .. 3
    sequence_parallel: bool = False   # with tp > 1: norms and dropouts on 1/tp of the sequence
    schedule: str = "1f1b"            # a pipeline schedule with one stage per rank ("gpipe", "1f1b", ...)
    micro_batches: int = 2            # per replica and step
    recompute: bool = False           # pipeline stages keep only their input, forward again in backward
    order: str = DEFAULT_ORDER        # the mesh's axis order, fastest first
    sync: str = "zero"                # what the dp axis runs (parallel_lib.training.data_axis.SYNCS)
    cp: int = 1                       # context parallel: each sequence cut into cp shards, ring attention
    cp_layout: str = "zigzag"         # which tokens a cp rank holds: "zigzag" (causally balanced) or "contiguous"
    ep: int = 1                       # expert parallel: the run's experts spread over ep ranks

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, order=self.order)

    @property
    def replicas(self) -> int:
        """The ranks that each train on a part of every global batch and average their gradients: dp · cp · ep.

        Every rank's loss is its tokens' weighted sum divided by the global tokens over this, so
        that the mean over them (the gradient's average over the flattened group) is one process's.
        """
        return self.dp * self.cp * self.ep

    @property
    def row_replicas(self) -> int:
        """The ranks that each take their own rows of every global batch: dp · ep (cp ranks share rows)."""
        return self.dp * self.ep

    @property
    def name(self) -> str:
        """A short label, e.g. ``"dp2 zero1 × tp2+sp × pp2 1f1b"``."""
        parts = []
        if self.dp > 1 or self.zero:
            parts.append(f"dp{self.dp}" + (f" zero{self.zero}" if self.zero else "")
                         + (f" {self.sync}" if self.sync != "zero" else ""))
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp} {self.schedule}" + (" recompute" if self.recompute else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + (" contiguous" if self.cp_layout == "contiguous" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return " × ".join(parts) or "one process"

    def check(self, world_size: Optional[int] = None, n_layer: Optional[int] = None, n_head: Optional[int] = None,
              vocab_size: Optional[int] = None, batch_size: Optional[int] = None) -> None:
        """Raise ValueError, naming the field, for a plan that cannot run on this world or model.

        Raises:
            ValueError: a size below 1, an unknown schedule or ZeRO stage, axes that do not
                multiply to ``world_size``, a tp that does not divide the heads or vocabulary,
                more stages than blocks, a batch that does not split into dp × ep × micro_batches,
                an unknown cp_layout, or a combination not supported yet (named, with what to use
                instead): cp or ep with pp > 1 or a sync other than "zero", cp with ep or with
                sequence_parallel, ep with tp > 1 or zero=3.
        """
        for axis in ("dp", "tp", "pp", "cp", "ep", "micro_batches"):
            positive_int(axis, getattr(self, axis))
        check_choice("cp_layout", self.cp_layout, LAYOUTS)
        check_choice("zero", self.zero, [0, 1, 2, 3])
        check_choice("schedule", self.schedule, sorted(SCHEDULES))
        check_choice("sync", self.sync, sorted(SYNCS))
        mesh = self.mesh
        if world_size is not None and world_size != mesh.world_size:
            axes = ["dp", "tp", "pp"] + [a for a in ("cp", "ep") if getattr(self, a) > 1]
            raise ValueError(f"{' * '.join(axes)} must equal world_size={world_size}, got "
                             f"{' x '.join(str(getattr(self, a)) for a in axes)} = {mesh.world_size}")
        if self.sync != "zero" and self.zero:
            raise ValueError(f"zero={self.zero} is the stage of ZeroEngine (sync='zero'); sync={self.sync!r} shards as "
                             "PyTorch does: leave zero=0")
        if self.sync in WHOLE_MODEL and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"sync={self.sync!r} shards the whole model over dp: it needs tp=1 and pp=1, got "
                             f"tp={self.tp}, pp={self.pp}; use sync='zero' to combine sharding with tp or pp")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits activations over the tp axis: it needs tp > 1")
        if self.sequence_parallel and self.zero >= 2:
            raise ValueError(f"sequence_parallel with zero={self.zero} is not supported yet: its norms' gradients "
                             "are summed over tp after backward, ZeRO-2/3 reduce them during it; use zero <= 1")
        if n_layer is not None and self.pp > n_layer:
            raise ValueError(f"pp must be <= the model's {n_layer} blocks (one per stage at least), got pp={self.pp}")
        for name, value in (("n_head", n_head), ("vocab_size", vocab_size)):
            if value is not None and value % self.tp:
                raise ValueError(f"tp={self.tp} must divide {name}={value}")
        if batch_size is not None and batch_size % (self.row_replicas * self.micro_batches):
            replicas = f"dp={self.dp}" + (f" x ep={self.ep}" if self.ep > 1 else "")
            raise ValueError(f"batch_size must split into {replicas} replicas of micro_batches="
                             f"{self.micro_batches} equal micro-batches, got batch_size={batch_size}")
        self._check_cp_ep()
        check_averager(self)  # chapter 01's averagers: what they cannot run

    def _check_cp_ep(self) -> None:
        """The combinations of cp and ep that the one training entry does not run yet."""
        for axis in ("cp", "ep"):
            size = getattr(self, axis)
            if size == 1:
                continue
            if self.sync != "zero":
                raise ValueError(f"{axis}={size} averages gradients with ZeroEngine over the flattened ('dp', "
                                 f"'{axis}') group: it needs sync='zero', got sync={self.sync!r}")
            if self.pp > 1:
                raise ValueError(f"{axis}={size} with pipeline parallelism (pp={self.pp}) is not supported yet: "
                                 f"use pp=1 (combine {axis} with dp{' or tp' if axis == 'cp' else ''} instead)")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(f"cp={self.cp} with ep={self.ep} is not supported yet: use one of them")
        if self.cp > 1 and self.sequence_parallel:
            raise ValueError("sequence_parallel with cp > 1 is not supported yet: the ring holds this rank's tokens "
                             "whole; use sequence_parallel=False")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(f"ep={self.ep} with tp={self.tp} is not supported yet: the experts are not split by "
                             "tensor parallelism; use tp=1")
        if self.ep > 1 and self.zero == 3:
            raise ValueError(f"ep={self.ep} with zero=3 is not supported yet: ZeRO-3 gathers parameters per block and "
                             "an expert runs only when tokens reach it; use zero <= 2")
