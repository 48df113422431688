"""Mixture-of-experts benchmark: ``python -m parallel_lib.bench moe [--quick]``.

Trains the tiny GPT-2 with every MLP a mixture of experts spread over ``ep`` ranks
(:func:`parallel_lib.expert_parallel.log_routing`, Zipf-distributed tokens as in text, no
capacity limit) for each ``ep``, top-k and balancing-loss weight, and prints per run:

- the step time (median over the steps after the first, the slowest rank's: every all-to-all
  waits for it);
- the load: the busiest expert and the busiest rank against the mean (measured routing, the last
  steps), and the seconds the busiest rank's experts computed against the mean over ranks;
- the all-to-all bytes per rank and step the collective counter saw, against
  :func:`parallel_lib.cost.moe.ep_traffic` (equal over the ranks whatever the imbalance: nothing
  is dropped, so each rank sends its tokens · top-k rows).

Then a rank's experts run as a loop of matrix multiplies against one grouped multiply
(:func:`parallel_lib.expert_parallel.time_expert_compute`), and Mixtral 8x7B and DeepSeek-V3 by
the cost model (:mod:`parallel_lib.cost.moe`): parameters, memory per GPU for a layout, and the
all-to-all bytes per GPU and step. Small models on a CPU: the times are indicative, the counts exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from parallel_lib.bench import parse_config
from parallel_lib.common.tables import markdown_table
from parallel_lib.cost.moe import DEEPSEEK_V3, MIXTRAL_8X7B, MoEShape, ep_traffic, moe_memory, moe_step_traffic
from parallel_lib.cost.units import GB, GiB
from parallel_lib.expert_parallel import load_by_step, log_routing, time_expert_compute
from parallel_lib.runtime.environment import machine_label
from parallel_lib.runtime.launcher import launch

__all__ = ["Config", "QUICK", "Row", "LAYOUTS", "measure", "markdown", "main"]

HIDDEN, LAYERS = 64, 4  # the tiny GPT-2


@dataclass(frozen=True)
class Config:
    ep_sizes: tuple[int, ...] = (1, 2, 4)
    top_ks: tuple[int, ...] = (1, 2)
    aux_coefs: tuple[float, ...] = (0.0, 0.1)
    n_experts: int = 8
    steps: int = 10
    rows: int = 4                # per rank
    seq: int = 32
    zipf: float = 1.2
    compute: tuple[tuple[int, int, int], ...] = ((8, 4096, 256), (32, 4096, 256))  # (experts, rows, hidden)
    repeat: int = 5


QUICK = Config(ep_sizes=(2,), top_ks=(1, 2), aux_coefs=(0.0, 0.1), n_experts=4, steps=2, rows=2, seq=8,
               compute=((4, 64, 16),), repeat=1)


@dataclass
class Row:
    ep: int
    top_k: int
    aux_coef: float
    step_s: float                # median over steps 1.., slowest rank
    expert_imbalance: float      # busiest expert / mean, mean over the last half of the steps and the layers
    rank_imbalance: float        # busiest rank / mean, the same
    expert_time_ratio: float     # seconds the busiest rank's experts computed / mean over ranks, the same steps
    counted: float               # all-to-all message bytes per rank and step, mean over ranks and steps
    formula: float               # ep_traffic's, the 4 mixture layers together
    equal: bool                  # counted == formula over the ranks in every step


def _runs(rank: int, world_size: int, config: Config) -> list[dict[str, Any]]:
    """A ``launch`` worker: :func:`log_routing` of every (top-k, balancing-loss weight) in turn."""
    return [log_routing(rank, world_size, dict(n_experts=config.n_experts, top_k=k), aux, steps=config.steps,
                        rows=config.rows, seq=config.seq, zipf=config.zipf, count=True)
            for k in config.top_ks for aux in config.aux_coefs]


def _median(values: Sequence[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _row(ep: int, top_k: int, aux: float, logs: list[dict[str, Any]], config: Config) -> Row:
    steps = load_by_step(logs)
    late = steps[len(steps) // 2:]
    layer = ep_traffic(config.rows * config.seq, top_k, HIDDEN, config.n_experts, ep)
    per_step = [sum(log["all_to_all"][s][1] for log in logs) for s in range(len(steps))]
    return Row(ep, top_k, aux, _median([s["step_s"] for s in steps[1:]] or [steps[0]["step_s"]]),
               sum(s["expert_imbalance"] for s in late) / len(late),
               sum(s["rank_imbalance"] for s in late) / len(late),
               sum(s["busiest_expert_s"] / max(s["mean_expert_s"], 1e-12) for s in late) / len(late),
               sum(per_step) / len(per_step) / ep, LAYERS * layer.message_bytes,
               all(total == ep * LAYERS * layer.message_bytes for total in per_step))


def measure(config: Config) -> tuple[list[Row], list[tuple[int, int, int, dict[str, float]]]]:
    """One launch per ep running every (top-k, weight); then the looped and grouped expert compute."""
    rows = []
    for ep in config.ep_sizes:
        per_rank = launch(_runs, ep, config, backend="gloo", timeout=1800)
        jobs = [(k, aux) for k in config.top_ks for aux in config.aux_coefs]
        rows += [_row(ep, k, aux, [r[j] for r in per_rank], config) for j, (k, aux) in enumerate(jobs)]
    compute = [(e, t, h, time_expert_compute(e, t, h, config.repeat)) for e, t, h in config.compute]
    return rows, compute


# (shape, ep, dp, pp, ZeRO stage, tokens per data-parallel rank and step, where the layout comes from)
LAYOUTS: tuple[tuple[MoEShape, int, int, int, int, int, str], ...] = (
    (MIXTRAL_8X7B, 8, 64, 1, 1, 4 * 4096, "8 nodes of 8 GPUs, EP 8 within a node; 4 sequences of 4096 per GPU"),
    (DEEPSEEK_V3, 64, 128, 16, 1, 15360 * 4096 // 128,
     "the report's sec. 3.2: 2048 GPUs, PP 16, EP 64, ZeRO-1; 15360 sequences of 4096 per step (sec. 4.2)"),
)


def real_models() -> list[list[str]]:
    """Mixtral 8x7B and DeepSeek-V3 by the cost model: parameters, a layout's memory per GPU and all-to-all bytes."""
    table = []
    for shape, ep, dp, pp, zero, tokens, where in LAYOUTS:
        memory = moe_memory(shape, ep, dp, pp, zero, "bf16")
        traffic = moe_step_traffic(shape, tokens, ep, dtype_bytes=2, layers=-(-shape.moe_layers // pp))
        table.append([shape.name, f"{shape.parameters() / 1e9:.1f}", f"{shape.active_parameters() / 1e9:.1f}",
                      f"EP {ep}, DP {dp}, PP {pp}, ZeRO-{zero}", f"{memory['total'] / GiB:.1f}",
                      f"{traffic.wire_bytes / GB:,.0f}", where])
    return table


def markdown(rows: Sequence[Row], compute: Sequence[tuple[int, int, int, dict[str, float]]],
             machine: str = "") -> str:
    """The measured tables and the real models'."""
    machine = machine or machine_label()
    table = [[r.ep, r.top_k, f"{r.aux_coef:g}", f"{1e3 * r.step_s:.1f}", f"{r.expert_imbalance:.2f}",
              f"{r.rank_imbalance:.2f}", f"{r.expert_time_ratio:.2f}", f"{r.counted / 1e3:.1f} / {r.formula / 1e3:.1f}",
              "yes" if r.equal else "NO"] for r in rows]
    looped = [[e, t, h, f"{1e3 * s['loop']:.2f}", f"{1e3 * s['grouped']:.2f}", f"{s['loop'] / s['grouped']:.2f}×"]
              for e, t, h, s in compute]
    return "\n".join([
        f"### Mixture of experts — step time, load and all-to-all bytes against ep and top-k, {machine}", "",
        markdown_table(["ep", "top-k", "balancing α", "step ms (slowest rank)", "busiest expert / mean",
                        "busiest rank / mean", "busiest rank's expert time / mean", "all-to-all KB per rank and step "
                        "(counted / formula)", "equal over the ranks"], table, "rrrrrrrrl"), "",
        "Tiny GPT-2 (4 mixture layers of GPT-2-MLP experts), Zipf-distributed tokens, no capacity limit; the load "
        "columns are the mean over the last half of the steps and the layers. Without the balancing loss the router "
        "collapses onto a few experts as it trains; the busiest rank then computes the most, and every all-to-all "
        "waits for it. A rank's bytes follow its experts' load (it sends its own rows and returns the ones it "
        "received), so the formula holds over the ranks, and rank by rank only when the routing is balanced.", "",
        f"A rank's experts (forward and backward), a loop of matrix multiplies against one grouped multiply, {machine}:",
        "",
        markdown_table(["experts", "rows", "hidden", "loop ms", "grouped ms", "loop / grouped"], looped, "rrrrrr"),
        "",
        "The loop launches 2 multiplies per expert (a kernel each on a GPU), of uneven sizes; the grouped one is one "
        "batched multiply over rows padded to the busiest expert.", "",
        "Real models by the same cost model (bf16 weights and gradients, fp32 Adam states; the all-to-all in bf16, "
        "forward and backward, the busiest stage's mixture layers; DeepSeek-V3 dispatches in FP8 and limits each "
        "token to 4 nodes, which this count leaves out):", "",
        markdown_table(["model", "parameters (B)", "active (B)", "layout", "model state GiB per GPU",
                        "all-to-all GB per GPU and step", "layout from"], real_models(), "lrrlrrl")])


def main(argv: list[str]) -> int:
    config, _ = parse_config(argv, "moe", __doc__, QUICK, Config, "4 experts on 2 ranks, 2 steps: a smoke run")
    print(markdown(*measure(config)))
    return 0
