"""Published training runs beside the planner: the layout each team used, and the one the planner prefers.

Each run is priced twice with the published GPU figures (:mod:`parallel_lib.planner.hardware`):
the team's own layout (its memory per GPU and predicted step), and the planner's best layout
from :func:`parallel_lib.planner.search.plan_layouts` for the same model, GPUs, memory and batch.
The Llama models have their real shapes (:data:`LLAMA3`: SwiGLU MLP, grouped-query attention with
8 key/value heads, RMSNorm, RoPE, an untied head; Llama Team 2024, table 3, and the released
checkpoints' ``config.json``, whose vocabulary is 128,256 with the special tokens): 8.03 B, 70.55 B
and 405.85 B parameters, as Hugging Face's model cards count them. Activations still use
Korthikanti et al.'s GPT-block formula (34·s·b·h per block in 16 bits, without attention scores).

Sources, each number with the page and table it was read from (re-read for issue #21; where a value is
not printed in the paper it says so and where it was taken from):
- Llama Team, AI @ Meta (Dubey et al.), "The Llama 3 Herd of Models", arXiv:2407.21783 (2024). Pages are
  the arXiv PDF's. Table 3 (p. 7): 405B has 126 layers, model dimension 16,384, FFN 53,248, 128 heads,
  8 key/value heads, vocabulary "128,000" (the released config.json's 128,256 counts the special tokens).
  Table 4 (p. 10), the 8K stage on 16,384 GPUs: TP 8, CP 1, PP 16, DP 128, sequence 8,192, batch size/DP 16
  (so 2,048 sequences, 16.8 M tokens, printed "16M"), 400 TFLOPs/GPU, 41 % BF16 MFU; H100 80GB HBM3
  (sec. 3.3.1, p. 8). Sec. 3.3.2 (pp. 10-12): FSDP shards optimizer states and gradients, and the
  parameters are not resharded after the forward (no second all-gather for the backward), which is
  ZeRO-2 here: the gradients reduce-scattered after each micro-batch's backward, the parameters gathered
  once per step; an interleaved schedule with V stages per rank (Narayanan et al. 2021); 8K sequences
  trained without activation checkpointing. Not printed in the paper, taken as assumptions: the
  micro-batch (one sequence, so m = 16), V = 2 (figure 6, p. 11, draws 8 stages on 4 ranks; the paper
  gives no V for the run: if "the first model chunk on the first stage has only the embedding" after it
  lost one layer, each chunk held one layer and V = 128/16 = 8), and sequence parallelism (sec. 3.3.2
  cites Korthikanti et al. 2023 for TP but does not say SP was on).
  Its long-context stage (:data:`LONG_CONTEXT`, table 4's third row, p. 10; sec. 3.4.2): 16,384 GPUs,
  TP 8, CP 16, PP 16, sequence 131,072, batch size/DP 16, 16M tokens, 380 TFLOPs/GPU, 38 % MFU. The
  row prints DP 4, which contradicts its own other columns (8·16·16·4 = 8,192 GPUs, 4·16·131,072 =
  8.4 M tokens); DP 8 makes both add up (16,384 GPUs, 16.8 M tokens), and the course uses 8. Context
  parallelism keeps 8,192 tokens of each sequence on a GPU, as in the 8K stage. (Meta's CP all-gathers
  the key/value heads, grouped-query attention's 8, sec. 3.3.2, where the planner prices the ring of
  chapter 11: the same bytes per rank, in cp - 1 steps.)
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21, arXiv:2104.04473). Table 1 (p. 8), the 145.6 B row: 96 heads, hidden 12,288, 80
  layers, TP 8, PP 8, 1,536 GPUs (so DP 24), batch 2,304, 148 teraFLOP/s per GPU, 47 % of peak; sec. 5.1
  (p. 8): vocabulary 51,200, sequence 2,048, the interleaved schedule with scatter/gather, mixed
  precision on A100 80GB (312 teraFLOP/s 16-bit peak), eq. 3 counting activation recomputation. Not in
  the paper, read from the authors' script for table 1 (Megatron-LM, ``examples/sc21/run_table_1.sh``,
  case 145B): micro-batch 2 (so m = 2,304 / (24 · 2) = 48), 5 layers per virtual stage (v = 80/8/5 = 2),
  uniform full recomputation, ``--fp16`` (``CONFIG.sh``).
  GPT-3 175 B: table 2 (p. 9), PTD-P rows: 174.6 B parameters, model-parallel size 96, batch 1,536,
  micro-batch 1, 1,536 GPUs (so DP 16, m = 96), 141 teraFLOP/s per GPU (no share of peak printed;
  141/312 = 45 %); the shape (96 layers, 96 heads, hidden 12,288) in sec. 5.3.2 (p. 9). The split of
  the 96 model-parallel GPUs is not in the paper: TP 8 × PP 12 and 2 layers per virtual stage (v =
  96/12/2 = 4) are the authors' own 175 B runs on 96 GPUs for figures 12 and 18
  (``examples/sc21/run_figure_12.sh``, ``run_figure_18.sh``); that table 2 used the same split is an
  assumption, the least certain value here.
- Hugging Face, "The Ultra-Scale Playbook" (2025): its benchmarks train Llama-style models at
  sequence 4096 with about 1 M tokens per batch on nodes of 8 H100 80 GB; the planner's answer for
  an 8 B model on 64 GPUs is shown without a published layout beside it (the playbook shows the
  best layouts as a heat map, not as one quotable configuration). Not re-read for issue #21.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from parallel_lib.cost.units import GiB
from parallel_lib.planner.hardware import GPUS, published_calibration
from parallel_lib.planner.layout import Layout, Priced, StepCost, price
from parallel_lib.planner.search import LayoutPlan, plan_layouts
from parallel_lib.cost.shape import LLAMA3, GPTShape

__all__ = ["LLAMA3", "PublishedRun", "RUNS", "LONG_CONTEXT", "Compared", "compare_run", "compare_all", "table"]


@dataclass(frozen=True)
class PublishedRun:
    name: str
    shape: GPTShape
    gpu: str                      # a key of hardware.GPUS
    devices: int
    global_batch: int             # sequences per step
    seq_len: int
    layout: Optional[Layout]      # what the team used (None: not published as one layout)
    source: str
    reported_tflops: Optional[float] = None  # achieved TFLOP/s per GPU, as the paper prints it
    reported_peak: Optional[float] = None    # the share of the peak it prints beside it (MFU), if it does


RUNS = (
    # Llama Team 2024, table 4 (p. 10), 2nd row: 16,384 GPUs, TP 8, CP 1, PP 16, DP 128, seq 8,192, batch size/DP 16
    # (2,048 sequences), 400 TFLOPs/GPU, 41 % BF16 MFU; ZeRO-2 and no recomputation from sec. 3.3.2 (p. 10-11).
    # Not in the paper: sequence parallelism, v = 2 and one sequence per micro-batch (m = 16); see the docstring.
    PublishedRun("Llama 3 405B", LLAMA3["405B"], "H100", 16384, 2048, 8192,
                 Layout(dp=128, tp=8, pp=16, zero=2, sequence_parallel=True, schedule="interleaved", virtual=2,
                        micro_batches=16, dtype="bf16"),
                 "Llama Team 2024, table 4, p. 10 (TP 8, CP 1, PP 16, DP 128)", 400.0, 0.41),
    # Narayanan et al. 2021, table 1 (p. 8), 145.6 B row: 96 heads, h 12,288, 80 layers, TP 8, PP 8, 1,536 GPUs,
    # batch 2,304, 148 teraFLOP/s per GPU, 47 % of peak; vocabulary 51,200 and sequence 2,048 from sec. 5.1.
    # Not in the paper: micro-batch 2 (m = 48), v = 2 and --fp16, from Megatron-LM's examples/sc21/run_table_1.sh.
    PublishedRun("GPT 145.6B (Megatron-LM)", GPTShape(80, 12288, 96, 51200, 2048), "A100", 1536, 2304, 2048,
                 Layout(dp=24, tp=8, pp=8, schedule="interleaved", virtual=2, micro_batches=48, recompute=True,
                        dtype="fp16"),
                 "Narayanan et al. 2021, table 1, p. 8 (TP 8, PP 8; micro-batch 2 from examples/sc21/run_table_1.sh)",
                 148.0, 0.47),
    # Narayanan et al. 2021, table 2 (p. 9), PTD-P at 1,536 GPUs: 174.6 B, model-parallel size 96, batch 1,536,
    # micro-batch 1, 141 teraFLOP/s per GPU (no share of peak printed); 96 layers, 96 heads, h 12,288 (sec. 5.3.2).
    # Not in the paper: TP 8 x PP 12 and v = 4, the authors' 175 B runs on 96 GPUs (examples/sc21/run_figure_12.sh).
    PublishedRun("GPT-3 175B (Megatron-LM)", GPTShape(96, 12288, 96, 51200, 2048), "A100", 1536, 1536, 2048,
                 Layout(dp=16, tp=8, pp=12, schedule="interleaved", virtual=4, micro_batches=96, recompute=True,
                        dtype="fp16"),
                 "Narayanan et al. 2021, table 2, p. 9 (model-parallel size 96; TP 8 x PP 12 from "
                 "examples/sc21/run_figure_12.sh)", 141.0),
    PublishedRun("Llama 3 8B, Ultra-Scale Playbook setting", LLAMA3["8B"], "H100", 64,
                 256, 4096, None, "Hugging Face 2025, The Ultra-Scale Playbook (sequence 4096, ~1M tokens per batch)"),
)


# the long-context stage (table 4's 3rd row, p. 10: TP 8, CP 16, PP 16, sequence 131,072, batch size/DP 16,
# 380 TFLOPs/GPU, 38 % MFU; the row prints DP 4, but 16,384 GPUs and 16M tokens need DP 8, see the docstring):
# not in RUNS, whose table chapter 10 prints; chapter 11 prices it
LONG_CONTEXT = PublishedRun("Llama 3 405B, long context", replace(LLAMA3["405B"], n_positions=131_072), "H100",
                            16384, 128, 131_072,
                            Layout(dp=8, tp=8, pp=16, cp=16, zero=2, sequence_parallel=True, schedule="interleaved",
                                   virtual=2, micro_batches=16, dtype="bf16"),
                            "Llama Team 2024, table 4, p. 10 (TP 8, CP 16, PP 16, DP 8 where the row prints 4, "
                            "sequence 131,072)", 380.0, 0.38)


@dataclass(frozen=True)
class Compared:
    run: PublishedRun
    theirs: Optional[Priced]
    plan: LayoutPlan
    note: str


def _why(theirs: Priced, ours: Priced) -> str:
    """One sentence on where the planner's layout differs from the team's, in the model's own terms."""
    a, b = theirs.layout, ours.layout
    if (a.dp, a.tp, a.pp) == (b.dp, b.tp, b.pp):
        return "the planner agrees on the grid; it differs only in " + (
            "ZeRO stage, schedule or recomputation, which change memory more than time in its model")
    reasons = []
    if b.pp < a.pp:
        reasons.append(f"fewer pipeline stages ({b.pp} vs {a.pp}) because its bubble and hops cost more than the "
                       "extra data-parallel all-reduce it prices at the published link speeds")
    if b.pp > a.pp:
        reasons.append(f"more pipeline stages ({b.pp} vs {a.pp}), fewer blocks per GPU, so that "
                       + (f"ZeRO-{b.zero} fits beside the activations" if b.zero < a.zero else
                          "it fits without recomputing"))
    if b.tp != a.tp:
        reasons.append(f"TP {b.tp} instead of {a.tp}")
    if b.zero > a.zero:
        freed = ("a smaller TP degree" if b.tp < a.tp else "fewer pipeline stages" if b.pp < a.pp else
                 "its layout")
        reasons.append(f"ZeRO-{b.zero} where they sharded {'nothing' if a.zero == 0 else f'to stage {a.zero}'}: "
                       f"sharding the model states over the data-parallel ranks frees the memory that lets {freed} "
                       "fit (Megatron-LM's 2021 runs replicated them; its distributed optimizer came later)")
    if b.zero < a.zero and a.zero >= 2 and a.micro_batches > 1:
        reasons.append(f"ZeRO-{b.zero} where they used ZeRO-{a.zero}: with {a.micro_batches} micro-batches per step "
                       f"ZeRO-2 reduce-scatters the gradients {a.micro_batches} times"
                       + (" and ZeRO-3 gathers the parameters twice as often" if a.zero == 3 else "")
                       + f" ({theirs.dp_comm:.2f} s of data-parallel collectives that the backward passes do not "
                       f"hide, against {ours.dp_comm:.2f} s)")
    if b.recompute and not a.recompute:
        reasons.append("activation recomputation, because their layout does not fit in its memory model")
    return ("the planner prefers " + "; ".join(reasons) +
            f" (predicted {ours.step_seconds:.2f} s vs {theirs.step_seconds:.2f} s per step at peak FLOP/s). It knows "
            "no failures, no network congestion and no kernel efficiency below peak, all of which make teams "
            "favour fewer, larger collectives")


def compare_run(run: PublishedRun, max_pp: int = 32, context_parallel: tuple[int, ...] = (1,)) -> Compared:
    """The team's layout and the planner's best, priced with the GPU's published peaks (``context_parallel``:
    the cp sizes the search tries, as :func:`~parallel_lib.planner.search.plan_layouts`)."""
    calibration = published_calibration(run.gpu)
    cost = StepCost(0.0, GPUS[run.gpu].flops_bf16)
    memory = GPUS[run.gpu].memory_bytes
    plan = plan_layouts(run.shape, run.devices, memory, run.global_batch, run.seq_len, calibration, cost,
                        dtype="bf16", max_pp=max_pp, schedules=("1f1b", "interleaved"),
                        context_parallel=context_parallel)
    theirs = price(run.layout, run.shape, run.global_batch, run.seq_len, calibration, cost) if run.layout else None
    if plan.best is None:
        note = "nothing fits on these GPUs in the planner's model"
    elif theirs is None:
        note = "no single published layout to compare with"
    else:
        note = _why(theirs, plan.best.priced)  # type: ignore[arg-type]
    return Compared(run, theirs, plan, note)


def compare_all(max_pp: int = 32) -> list[Compared]:
    return [compare_run(run, max_pp) for run in RUNS]


def _reported(run: PublishedRun) -> str:
    """What the paper reports the run achieved, as printed: TFLOP/s per GPU and, where printed, its share of peak."""
    if run.reported_tflops is None:
        return ""
    peak = f", {run.reported_peak:.0%} of peak" if run.reported_peak is not None else ""
    return f"; reported {run.reported_tflops:g} TFLOP/s per GPU{peak}"


def table(compared: list[Compared]) -> list[list[object]]:
    """Rows: run, GPUs, their layout and memory per GPU, the planner's and its memory, the note, and the
    source with the throughput the paper reports (:attr:`PublishedRun.reported_tflops`)."""
    gib = GiB
    rows = []
    for c in compared:
        best = c.plan.best
        rows.append([c.run.name, f"{c.run.devices} {c.run.gpu}",
                     c.run.layout.name if c.run.layout else "—",
                     f"{c.theirs.memory_bytes / gib:.1f}" if c.theirs else "—",
                     best.layout.name if best else "none fits",
                     f"{best.priced.memory_bytes / gib:.1f}" if best and best.priced else "—",
                     c.note, c.run.source + _reported(c.run)])
    return rows
