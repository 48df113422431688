"""Published training runs beside the planner: the layout each team used, and the one the planner prefers.

Each run is priced twice with the published GPU figures (:mod:`parallel_lib.planner.hardware`):
the team's own layout (its memory per GPU and predicted step), and the planner's best layout
from :func:`parallel_lib.planner.search.plan_layouts` for the same model, GPUs, memory and batch.
The Llama models have their real shapes (:data:`LLAMA3`: SwiGLU MLP, grouped-query attention with
8 key/value heads, RMSNorm, RoPE, an untied head; Llama Team 2024, table 3, and the released
checkpoints' ``config.json``, whose vocabulary is 128,256 with the special tokens): 8.03 B, 70.55 B
and 405.85 B parameters, as Hugging Face's model cards count them. Activations still use
Korthikanti et al.'s GPT-block formula (34·s·b·h per block in 16 bits, without attention scores).

Sources (numbers as the papers report them):
- Llama Team, "The Llama 3 Herd of Models" (2024), table 4 and sec. 3.3.2: 405B (126 layers,
  h 16384, 128 heads, vocabulary 128,256), 16,384 H100 80 GB, TP 8 × CP 1 × PP 16 × DP 128 at
  sequence 8192, 16 M tokens per batch (2048 sequences, 16 per replica: m = 16 micro-batches); FSDP
  sharding of optimizer states and gradients over DP with the parameters not resharded after the
  forward (sec. 3.3.2: no second all-gather for the backward), which is ZeRO-2 here: the gradients
  reduce-scattered after each micro-batch's backward, the parameters gathered once per step;
  400 TFLOP/s per GPU (41 % of the bf16 peak). Its long-context stage (:data:`LONG_CONTEXT`, table 4's
  second row, sec. 3.4.2): sequence 131,072 on the same 16,384 GPUs with TP 8 × CP 16 × PP 16 × DP 8,
  16 sequences per replica (16 M tokens per batch), 380 TFLOP/s per GPU (38 %); context
  parallelism keeps 8,192 tokens of each sequence on a GPU, as in the 8K stage. (Meta's CP
  all-gathers the key/value heads, grouped-query attention's 8, where the planner prices the ring
  of chapter 11: the same bytes per rank, in cp − 1 steps.)
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", table 1: the 145.6 B GPT (80 layers, h 12288, 96 heads, vocabulary 51,200,
  sequence 2048) on 1536 A100 80 GB with TP 8 × PP 8 × DP 24, batch 2304, interleaved schedule,
  activation recomputation; and sec. 5 / table 2: GPT-3 175 B (96 layers, same width) with
  model-parallel size 96 = TP 8 × PP 12, batch 1536 on 1536 GPUs (DP 16).
- Hugging Face, "The Ultra-Scale Playbook" (2025): its benchmarks train Llama-style models at
  sequence 4096 with about 1 M tokens per batch on nodes of 8 H100 80 GB; the planner's answer for
  an 8 B model on 64 GPUs is shown without a published layout beside it (the playbook shows the
  best layouts as a heat map, not as one quotable configuration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from parallel_lib.cost.units import GiB
from parallel_lib.planner.hardware import GPUS, published_calibration
from parallel_lib.planner.layout import Layout, Priced, StepCost, price
from parallel_lib.planner.search import LayoutPlan, plan_layouts
from parallel_lib.tensor_parallel.cost import GPTShape

__all__ = ["LLAMA3", "PublishedRun", "RUNS", "LONG_CONTEXT", "Compared", "compare_run", "compare_all", "table"]


def _llama(n_layer: int, n_embd: int, n_head: int, ffn_hidden: int, context: int = 8192) -> GPTShape:
    """A Llama 3 decoder: SwiGLU, 8 key/value heads, RMSNorm, RoPE, untied head, no biases, 128,256 tokens."""
    return GPTShape(n_layer, n_embd, n_head, 128_256, context, ffn_hidden=ffn_hidden, kv_heads=8, gated_mlp=True,
                    rms_norm=True, bias=False, learned_positions=False, tied_head=False)


# Llama Team 2024, "The Llama 3 Herd of Models", table 3 (layers, model dimension, FFN dimension, heads, 8 KV heads)
LLAMA3 = {"8B": _llama(32, 4096, 32, 14_336), "70B": _llama(80, 8192, 64, 28_672),
          "405B": _llama(126, 16_384, 128, 53_248)}


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


RUNS = (
    PublishedRun("Llama 3 405B", LLAMA3["405B"], "H100", 16384, 2048, 8192,
                 Layout(dp=128, tp=8, pp=16, zero=2, sequence_parallel=True, schedule="interleaved", virtual=2,
                        micro_batches=16, dtype="bf16"),
                 "Llama Team 2024, table 4 (TP 8, CP 1, PP 16, DP 128)"),
    PublishedRun("GPT 145.6B (Megatron-LM)", GPTShape(80, 12288, 96, 51200, 2048), "A100", 1536, 2304, 2048,
                 Layout(dp=24, tp=8, pp=8, schedule="interleaved", virtual=2, micro_batches=96, recompute=True,
                        dtype="bf16"),
                 "Narayanan et al. 2021, table 1 (TP 8, PP 8)"),
    PublishedRun("GPT-3 175B (Megatron-LM)", GPTShape(96, 12288, 96, 51200, 2048), "A100", 1536, 1536, 2048,
                 Layout(dp=16, tp=8, pp=12, schedule="interleaved", virtual=2, micro_batches=96, recompute=True,
                        dtype="bf16"),
                 "Narayanan et al. 2021, sec. 5 / table 2 (model-parallel size 96 = TP 8 x PP 12)"),
    PublishedRun("Llama 3 8B, Ultra-Scale Playbook setting", LLAMA3["8B"], "H100", 64,
                 256, 4096, None, "Hugging Face 2025, The Ultra-Scale Playbook (sequence 4096, ~1M tokens per batch)"),
)


# the long-context stage (table 4, CP 16): not in RUNS, whose table chapter 10 prints; chapter 11 prices it
LONG_CONTEXT = PublishedRun("Llama 3 405B, long context", _llama(126, 16_384, 128, 53_248, context=131_072), "H100",
                            16384, 128, 131_072,
                            Layout(dp=8, tp=8, pp=16, cp=16, zero=2, sequence_parallel=True, schedule="interleaved",
                                   virtual=2, micro_batches=16, dtype="bf16"),
                            "Llama Team 2024, table 4 (TP 8, CP 16, PP 16, DP 8, sequence 131,072)")


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
        reasons.append(f"ZeRO-{b.zero} where they sharded {'nothing' if a.zero == 0 else f'to stage {a.zero}'}: "
                       "sharding the optimizer states over the data-parallel ranks frees the memory that lets a "
                       "smaller TP degree fit (Megatron-LM's 2021 runs replicated them; its distributed optimizer "
                       "came later)")
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


def table(compared: list[Compared]) -> list[list[object]]:
    """Rows: run, GPUs, their layout and memory per GPU, the planner's and its memory, the note."""
    gib = GiB
    rows = []
    for c in compared:
        best = c.plan.best
        rows.append([c.run.name, f"{c.run.devices} {c.run.gpu}",
                     c.run.layout.name if c.run.layout else "—",
                     f"{c.theirs.memory_bytes / gib:.1f}" if c.theirs else "—",
                     best.layout.name if best else "none fits",
                     f"{best.priced.memory_bytes / gib:.1f}" if best and best.priced else "—",
                     c.note, c.run.source])
    return rows
