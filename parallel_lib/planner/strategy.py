"""Choosing a strategy: the named layouts of chapters 01–07 on a cluster the reader may not have.

Chapters 01–07 each measured one strategy; chapter 05 puts them side by side so the choice is
reasoned rather than guessed. Each named strategy is a :class:`~parallel_lib.planner.layout.Layout`,
priced by :func:`~parallel_lib.planner.layout.price`, the same pricing chapter 10's search uses
(memory from the tensor census's formulas, traffic and time on the link each group crosses, the
pipeline simulated, overlap as the engines do it). This module only says which layouts the names
stand for, and tries them in order until one fits; it has no formula of its own:

- **DP**: one replica per GPU (as many as divide the batch), ``Layout(dp=d)``;
- **MP**: the model split over every GPU (one block per stage at least), one micro-batch in the
  pipeline at a time (chapter 03; the schedule :func:`~parallel_lib.planner.layout.sequential`);
- **PP**: the same split, the micro-batches in ``schedule`` order (chapter 04);
- **DP×PP**: the fewest stages (at least 2) whose pipeline fits, replicated over the GPUs left;
- **ZeRO** (chapter 06): DP's replicas with the lowest ZeRO stage that fits;
- **TP×DP** (chapter 07): the smallest tensor-parallel degree (dividing the heads and the
  vocabulary, within a node) that fits with sequence parallelism, replicated over the rest.

Where a layout does not fit, DP, MP, ZeRO and TP×DP first accumulate gradients over the fewest
micro-batches that fit (same step, same result, smaller matrices), then every strategy tries
activation recomputation; DP×PP only when no stage count fits without it. The pick is the feasible
option with the shortest predicted step. Memory is in GiB (2**30 bytes), traffic in GB (10**9).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence, Union

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.cost.shape import SHAPES, GPTShape, shape_of
from parallel_lib.cost.units import GiB
from parallel_lib.planner.calibrate import Calibration
from parallel_lib.planner.hardware import Links, group_span
from parallel_lib.pipeline_parallel.microbatch import stage_blocks
from parallel_lib.planner.layout import Layout, MemoryCost, Priced, StepCost, price, price_memory
from parallel_lib.planner.option import PART_ONE, STRATEGIES, WHEN_TO_USE, Option, Plan
from parallel_lib.planner.search import divisors

__all__ = ["PART_ONE", "STRATEGIES", "WHEN_TO_USE", "Option", "Plan", "plan", "fewest_stages"]

DTYPES = ("fp16", "bf16", "fp32")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")


def fewest_stages(fits: Callable[[int, int], bool], n_gpus: int, n_layers: int, min_stages: int = 1,
                  min_replicas: int = 1) -> Optional[tuple[int, int]]:
    """``(stages, replicas)``: the fewest stages for which ``fits(stages, n_gpus // stages)``; None if none.

    Fewer stages mean a smaller bubble and fewer hand-overs; the GPUs left over go to more
    replicas, which also shrink each replica's share of the batch (so ``fits`` is asked with the
    replicas it would really have). A stage holds one block at least: at most ``n_layers`` stages.
    """
    for stages in range(min_stages, min(n_gpus, n_layers) + 1):
        replicas = n_gpus // stages
        if replicas < min_replicas:
            break
        if fits(stages, replicas):
            return stages, replicas
    return None


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in divisors(n) if d <= at_most)


@dataclass(frozen=True)
class _Inputs:
    """What :func:`plan` was asked, checked; :meth:`priced` prices any layout of it."""

    shape: GPTShape
    seq_len: int
    batch_size: int
    gpu_bytes: float
    n_gpus: int
    dtype: str
    schedule: str
    links: Links
    attention_scores: bool
    accumulate: bool
    recompute: bool
    micro_batches: Optional[int]
    calibration: Calibration

    def priced(self, layout: Layout) -> Priced:
        """``layout`` priced by :func:`~parallel_lib.planner.layout.price` at the GPUs' published peak."""
        rate = self.calibration.ranks[1].flops_per_second
        return price(replace(layout, dtype=self.dtype), self.shape, self.batch_size, self.seq_len, self.calibration,
                     StepCost(0.0, rate), self.attention_scores)

    def memory(self, layout: Layout) -> MemoryCost:
        """The memory half of :meth:`priced` (no step simulated): what the memory tests ask."""
        return price_memory(replace(layout, dtype=self.dtype), self.shape, self.batch_size, self.seq_len,
                            self.attention_scores)

    def rows(self, dp: int) -> int:
        return self.batch_size // dp

    def pipeline(self, stages: int, replicas: int = 1) -> Layout:
        """A pipeline's layout: its micro-batches (default 4p, the GPipe paper's rule) divide the replica's rows."""
        wanted = self.micro_batches or 4 * stages
        m = _largest_divisor(self.rows(replicas), wanted)
        return Layout(dp=replicas, pp=stages, schedule=self.schedule, micro_batches=m)

    def accumulated(self, layout: Layout) -> list[Layout]:
        """``layout``, then (if ``accumulate``) the same with more micro-batches, one after another, fewest first."""
        rows = self.rows(layout.dp)
        first = _largest_divisor(rows, self.micro_batches) if self.micro_batches else layout.micro_batches
        counts = [first] + ([m for m in divisors(rows) if m > first] if self.accumulate else [])
        return [replace(layout, micro_batches=m) for m in counts]

    def option(self, strategy: str, tries: Iterable[Layout], notes: Sequence[str] = (), blocker: str = "",
               retry: bool = True) -> Option:
        """The first of ``tries`` that fits, as ``strategy``; else the one that needs the least memory, infeasible.

        With ``recompute`` (and ``retry``), every try is tried once more with activation recomputation after
        all the others.
        """
        tries = list(tries)[:1] if blocker else list(tries)
        if self.recompute and retry and not blocker:
            tries += [replace(layout, recompute=True) for layout in tries]
        least, least_bytes = None, float("inf")
        for layout in tries:
            need = self.memory(layout).memory_bytes
            if not blocker and need <= self.gpu_bytes:
                return self._option(strategy, self.priced(layout), True, notes)
            if need < least_bytes:
                least, least_bytes = layout, need
        assert least is not None
        return self._option(strategy, self.priced(least), False, notes, blocker)

    def _option(self, strategy: str, p: Priced, fits: bool, notes: Sequence[str], blocker: str = "") -> Option:
        """The option's record: its name and the reasons, every number read from the pricing ``p``."""
        L, s = p.layout, self.shape
        name = f"ZeRO-{L.zero}" if strategy == "ZeRO" and fits else strategy  # "ZeRO": no stage fits
        sizes = dict(tp=L.tp, pp=L.pp, dp=L.dp)
        mb = self.rows(L.dp) // L.micro_batches
        why = [blocker] if blocker else []
        why += [f"{p.state_bytes / GiB:.1f} GiB of training state ({p.params / 1e9:.2f} B parameters on the busiest GPU"
               + (f", ZeRO-{L.zero} over {L.dp} replicas" if L.zero else "") + ")"
               + (f" + {p.working_bytes / GiB:.1f} GiB gathered by ZeRO-3" if p.working_bytes else "")
               + f" + {p.activation_bytes / GiB:.1f} GiB of activations ({p.in_flight:g} micro-batch(es) of {mb} "
               f"sequence(s) x {max(len(b) for b in stage_blocks(s.n_layer, L.pp))} block(s){', recomputed' if L.recompute else ''})"
               f" = {p.memory_bytes / GiB:.1f} GiB {'<=' if p.memory_bytes <= self.gpu_bytes else '>'} "
               f"{self.gpu_bytes / GiB:g} GiB per GPU"]
        if L.pp == 1 and L.micro_batches > 1:
            why.append(f"gradient accumulation: {L.micro_batches} micro-batches of {mb} sequence(s), one after "
                       "another, one optimizer step")
        if L.recompute:
            why.append("activation recomputation: each block keeps only its input and runs its forward again in "
                       "backward (its FLOPs, and its tensor-parallel collectives, once more)")
        why += notes
        if L.pp > 1:
            why.append(f"bubble {p.bubble / (1 + p.bubble):.0%} of the step ({L.schedule}, p={L.pp}, "
                       f"m={L.micro_batches}, simulated); the busiest stage sends {p.sent.get('pp', 0.0) / 1e9:.3f} GB "
                       "of hidden states and their gradients per step")
        if L.tp > 1:
            why.append(f"tensor parallelism over {L.tp} GPUs with sequence parallelism: "
                       f"{p.sent.get('tp', 0.0) / 1e9:.3f} GB sent per GPU per step, on the critical path")
        if L.dp > 1:
            what = f"ZeRO-{L.zero}'s collectives" if L.zero else "ring all-reduce of the gradients"
            why.append(f"{what} over {L.dp} replicas: {p.sent.get('dp', 0.0) / 1e9:.3f} GB sent per GPU per step")
        over = ([f"gradients on {self.links.describe(group_span('dp', sizes))}"] if L.dp > 1 else []) + \
            ([f"layers' collectives on {self.links.describe(group_span('tp', sizes))}"] if L.tp > 1 else []) + \
            ([f"hidden states on {self.links.describe(group_span('pp', sizes))}"] if L.pp > 1 else [])
        why.append(f"communication {p.comm_seconds * 1e3:.1f} ms per step" + (f" ({'; '.join(over)})" if over else "")
                   + f", {p.dp_hidden * 1e3:.1f} ms of it hidden behind compute")
        why.append(f"step {p.step_seconds:.2f} s at {self.links.gpu}'s published peak: compute {p.compute:.2f} s "
                   f"(bubble and layers' collectives included) + {p.dp_comm:.3f} s of exposed data-parallel "
                   f"communication + {p.optimizer:.3f} s of optimizer")
        return Option(name, L, p, fits, tuple(why))

    def _split(self, stages: int, replicas: int, recompute: bool) -> list[Layout]:
        """The layouts of ``replicas`` copies of a ``stages``-stage split: DP accumulating, or one pipeline."""
        tries = self.accumulated(Layout(dp=replicas)) if stages == 1 else [self.pipeline(stages, replicas)]
        return [replace(t, recompute=recompute) for t in tries]

    def fits_memory(self, stages: int, replicas: int, recompute: bool = False) -> bool:
        """Whether ``replicas`` copies of a ``stages``-stage split fit in memory (the exercise's test)."""
        if stages > self.shape.n_layer or self.batch_size % replicas:
            return False
        return any(self.memory(t).memory_bytes <= self.gpu_bytes for t in self._split(stages, replicas, recompute))

    def fits(self, stages: int, replicas: int, recompute: bool = False) -> Optional[Option]:
        """The feasible option of ``replicas`` copies of a ``stages``-stage split, priced, or None."""
        if not self.fits_memory(stages, replicas, recompute):
            return None
        strategy = "DP" if stages == 1 else ("PP" if replicas == 1 else "DP×PP")
        return self.option(strategy, self._split(stages, replicas, recompute), retry=False)

    def layout(self) -> Optional[tuple[int, int]]:
        """:func:`fewest_stages` under :meth:`fits_memory` without recomputation: :attr:`Plan.layout`."""
        return fewest_stages(self.fits_memory, self.n_gpus, self.shape.n_layer)

    def search(self, min_stages: int, min_replicas: int) -> Optional[Option]:
        """:func:`fewest_stages` under this plan's memory test; recomputation only if nothing fits without."""
        for recompute in (False, True) if self.recompute else (False,):
            found = fewest_stages(lambda stages, replicas: self.fits_memory(stages, replicas, recompute),
                                  self.n_gpus, self.shape.n_layer, min_stages, min_replicas)
            if found is not None:
                return self.fits(*found, recompute)
        return None

    def tp_degrees(self) -> list[int]:
        """Tensor-parallel degrees 2..(a node) splitting the heads and vocabulary, with replicas dividing the batch."""
        out = []
        for t in range(2, min(self.n_gpus, self.links.gpus_per_node) + 1):
            try:
                self.shape.check_tp(t)
            except ValueError:
                continue
            if self.n_gpus % t == 0 and self.batch_size % (self.n_gpus // t) == 0:
                out.append(t)
        return out

    def options(self, strategies: Sequence[str]) -> tuple[Option, ...]:
        n, split = self.n_gpus, min(self.n_gpus, self.shape.n_layer)
        d = _largest_divisor(self.batch_size, n)  # data-parallel replicas: each takes an equal share of the batch
        idle = [f"the batch of {self.batch_size} sequences splits evenly over {d} of {n} GPUs"
                if d < n else "no bubble: every GPU computes the whole step"]
        out = {"DP": lambda: self.option("DP", self.accumulated(Layout(dp=d)), idle)}
        short = [f"{self.shape.n_layer} blocks make at most {split} stages: {n - split} GPU(s) idle"
                 ] if split < n else []
        cannot = "one GPU cannot be split into stages" if split < 2 else ""
        out["MP"] = lambda: self.option("MP", self.accumulated(Layout(pp=split, schedule="sequential"))
                                        if split > 1 else [Layout()], short + ["one stage computes at a time"], cannot)
        out["PP"] = lambda: self.option("PP", [self.pipeline(split)] if split > 1 else [Layout()], short, cannot)

        def hybrid() -> Option:
            found = self.search(2, 2)  # the fewest stages that hold a replica, replicated n // stages times
            if found is not None:
                note = f"{found.stages} stages are the fewest that hold a replica; {n} GPUs hold {found.replicas}"
                return replace(found, strategy="DP×PP", reasons=found.reasons + (note,))
            blocker = f"fewer than 2 replicas of a pipeline that fits find room on {n} GPU(s)"
            return self.option("DP×PP", [self.pipeline(split)] if split > 1 else [Layout()], (), blocker)
        out["DP×PP"] = hybrid
        out["ZeRO"] = lambda: self.option(
            "ZeRO", [t for z in (1, 2, 3) for t in self.accumulated(Layout(dp=d, zero=z))], idle,
            "" if d > 1 else "one replica: no data-parallel ranks to shard the state over")

        def tensor_parallel() -> Option:
            degrees = self.tp_degrees()
            if not degrees:
                blocker = (f"no degree 2..{min(n, self.links.gpus_per_node)} divides the {self.shape.n_head} heads, "
                           f"the vocabulary of {self.shape.vocab_size} and the {n} GPU(s) (with replicas dividing "
                           "the batch)")
                return self.option("TP×DP", [Layout(dp=d)], (), blocker)
            tries = [t for k in degrees for t in self.accumulated(Layout(dp=n // k, tp=k, sequence_parallel=True))]
            return self.option("TP×DP", tries, [f"tp within a node of {self.links.gpus_per_node} GPUs"])
        out["TP×DP"] = tensor_parallel
        return tuple(out[name]() for name in strategies)


def plan(model: Union[str, GPTShape], seq_len: int, batch_size: int, gpu_gib: float, n_gpus: int,
         dtype: str = "fp16", schedule: str = "1f1b", micro_batches: Optional[int] = None,
         links: Union[str, Links] = "H100", attention_scores: bool = False, accumulate: bool = True,
         recompute: bool = True, strategies: Sequence[str] = PART_ONE) -> Plan:
    """Price every named strategy for training ``model`` on ``n_gpus`` GPUs of ``gpu_gib`` GiB.

    Layouts (module docstring): DP runs one replica per GPU (as many as divide the batch); MP and PP
    split the model over all GPUs (at least one block per stage), MP one micro-batch at a time
    (chapter 03), PP with ``micro_batches``; DP×PP splits each replica over the fewest stages (at
    least 2) that hold it and runs ``n_gpus // stages`` such pipelines; ZeRO and TP×DP as chapters
    06 and 07. Each is priced by :func:`parallel_lib.planner.layout.price` with mixed-precision
    AdamW (16 bytes per parameter) at the GPUs' published peak (``links``).

    Args:
        model: a name from :data:`parallel_lib.cost.shape.SHAPES` or a :class:`~parallel_lib.cost.shape.GPTShape`.
        seq_len: tokens per sequence.
        batch_size: sequences per step, the global batch.
        gpu_gib: memory of one GPU in GiB.
        n_gpus: GPUs available.
        dtype: "fp16"/"bf16" (mixed precision) or "fp32".
        schedule: "1f1b" (a stage keeps at most p micro-batches) or "gpipe" (all m).
        micro_batches: per replica and step (the largest count up to it that divides the replica's
            sequences); default ``4 p`` for a pipeline (the GPipe paper: with m >= 4p the bubble is
            small), 1 otherwise.
        links: the cluster: a GPU name of :data:`~parallel_lib.planner.hardware.GPUS` (its DGX node: 8 GPUs
            on NVLink, InfiniBand between nodes) or a :class:`~parallel_lib.planner.hardware.Links`.
        attention_scores: count stored attention score matrices (no FlashAttention).
        accumulate: let DP, MP, ZeRO and TP×DP split their batch into micro-batches (gradient accumulation).
        recompute: allow activation recomputation where nothing fits without it.
        strategies: which of :data:`STRATEGIES` to price; by default Part I's four. Add "ZeRO" and
            "TP×DP" (or pass ``STRATEGIES``) for sharded data parallelism and tensor parallelism.

    Raises:
        ValueError: an unknown model, dtype, schedule or GPU name for ``links``, a size that is not
            positive and finite, or a ``gpu_gib`` so large that it must be bytes.
        TypeError: ``model`` is neither a name nor a ``GPTShape``; ``links`` neither a name nor ``Links``.
    """
    if isinstance(model, str):
        if model not in SHAPES:
            raise ValueError(f"model must be one of {sorted(SHAPES)} or a GPTShape, got model={model!r}")
        name = model
    elif isinstance(model, GPTShape):
        name = None
    else:
        raise TypeError(f"model must be a name or a GPTShape, got {type(model).__name__}")
    shape = shape_of(model)
    for arg, value in (("seq_len", seq_len), ("batch_size", batch_size), ("n_gpus", n_gpus)):
        positive_int(arg, value)
    if micro_batches is not None:
        positive_int("micro_batches", micro_batches)
    if isinstance(links, str):
        links = Links.of(links)
    elif not isinstance(links, Links):
        raise TypeError(f"links must be a GPU name such as 'H100' or a planner.hardware.Links, got "
                        f"{type(links).__name__}")
    if positive_number("gpu_gib", gpu_gib) > 2**20:  # a mebi-GiB GPU (a pebibyte) is bytes given for GiB
        raise ValueError(f"gpu_gib is in GiB, got gpu_gib={gpu_gib!r}, which looks like bytes; "
                         f"pass {gpu_gib!r} / GiB (= {gpu_gib / GiB:g})")
    check_choice("dtype", dtype, DTYPES)
    check_choice("schedule", schedule, PIPELINE_SCHEDULES)
    if isinstance(strategies, str) or not strategies or set(strategies) - set(STRATEGIES):
        raise ValueError(f"strategies must be a non-empty list from {STRATEGIES}, got strategies={strategies!r}")
    if seq_len % 2:
        raise ValueError(f"seq_len must be even (the pricing's zig-zag halves), got seq_len={seq_len}")
    inputs = _Inputs(shape, seq_len, batch_size, gpu_gib * GiB, n_gpus, dtype, schedule, links, attention_scores,
                     bool(accumulate), bool(recompute), micro_batches, links.calibration())
    plan_ = Plan(name or "", shape, seq_len, batch_size, gpu_gib * GiB, n_gpus, links,
                 inputs.options([s for s in STRATEGIES if s in strategies]), inputs)
    return plan_ if name else replace(plan_, model=f"{plan_.n_params / 1e9:.2f} B parameters")
