"""Chapter 12's GPU check: expert parallelism on NCCL ranks equals the one-process mixture, its bytes the formula.

:mod:`parallel_lib.gpu_checks` registers :func:`check_expert_parallel` as ``expert_parallel``. Each
of the ``n_gpus`` ranks holds ``E/ep`` experts (``E = 2·ep``) on its GPU; the one-process layer
runs on the CPU from the same seed. Then the all-to-alls are counted against
:func:`parallel_lib.cost.moe.ep_traffic`, and the tiny mixture GPT-2 trains with and without the
balancing loss while its routing is logged (:func:`parallel_lib.expert_parallel.log_routing`).
"""

from __future__ import annotations

from typing import Any

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.launcher import launch

__all__ = ["CASES", "expert_parallel_run", "check_expert_parallel"]

# MoEConfig fields per case (n_experts is 2·ep); top-1 without drops, top-2 with drops and a shared expert,
# top-2 through the grouped multiply
CASES = (dict(top_k=1), dict(top_k=2, capacity_factor=1.0, shared_expert=True),
         dict(top_k=2, normalize=True, expert_compute="grouped"))


def expert_parallel_run(rank: int, world_size: int, quick: bool) -> dict[str, Any]:
    """A ``launch`` worker: the layer against one process, its counted all-to-alls, and the routing logs."""
    from parallel_lib.expert_parallel import log_routing
    from parallel_lib.expert_parallel.verify import ep_matches_one_process, ep_traffic_counted

    cases = [dict(fields, n_experts=2 * world_size) for fields in CASES]
    steps = 4 if quick else 12
    return dict(cases=ep_matches_one_process(rank, world_size, cases, steps=3),
                traffic=ep_traffic_counted(rank, world_size, n_experts=2 * world_size),
                logs={aux: log_routing(rank, world_size, dict(n_experts=2 * world_size, top_k=1), aux, steps=steps,
                                       rows=4, seq=32, zipf=1.2, count=True) for aux in (0.0, 0.1)})


def check_expert_parallel(n_gpus: int, quick: bool = False) -> str:
    """Chapter 12: expert parallelism over ``n_gpus`` ranks; outputs, gradients, AdamW steps vs one process,
    all-to-all bytes vs the formula, and the load with and without the balancing loss."""
    from parallel_lib.cost.moe import ep_traffic
    from parallel_lib.expert_parallel import load_by_step
    from parallel_lib.expert_parallel.verify import HIDDEN

    ep = n_gpus
    results = launch(expert_parallel_run, n_gpus, quick, timeout=600)
    rows = []
    for n, fields in enumerate(CASES):
        cases = [r["cases"][n] for r in results]
        output = max(max(c["output"], c["input_grad"]) for c in cases)
        grads = max(max(c["grads"].values()) for c in cases)
        after = max(c["after_steps"] for c in cases)
        # float noise only (~1e-7 on the CPU; a GPU's kernels sum in another order); a wrong route moves them ~1e-2
        if output > 1e-4 or grads > 1e-4 or after > 1e-3:
            raise CheckError(f"expert parallelism (ep={ep}, {fields}) differs from one process: outputs by "
                             f"{output:.3g}, gradients by {grads:.3g}, parameters after 3 AdamW steps by {after:.3g}")
        rows.append([", ".join(f"{k}={v}" for k, v in fields.items()), f"{output:.1e}", f"{grads:.1e}",
                     f"{after:.1e}", sum(c["dropped"] for c in cases)])
    formula = ep_traffic(tokens=16, top_k=2, hidden=HIDDEN, n_experts=2 * ep, ep=ep)
    for rank, r in enumerate(results):
        counted = sum(n for n, _ in r["traffic"]["calls"])
        if counted != formula.message_bytes:
            raise CheckError(f"rank {rank}: its all-to-alls moved {counted} bytes, the formula says "
                             f"{formula.message_bytes}")
    load = []
    for aux in (0.0, 0.1):
        steps = load_by_step([r["logs"][aux] for r in results])
        last = steps[-1]
        step_ms = sorted(1e3 * s["step_s"] for s in steps[1:])
        load.append([f"{aux:g}", f"{steps[0]['expert_imbalance']:.2f} -> {last['expert_imbalance']:.2f}",
                     f"{last['rank_imbalance']:.2f}", " ".join(str(n) for n in last["per_rank"]),
                     f"{step_ms[len(step_ms) // 2]:.1f}"])
    return "\n".join([
        f"Expert parallelism on {n_gpus} ranks ({2 * ep} experts, {launch.__module__} picks NCCL with a GPU per rank) "
        "against the one-process layer on the CPU:", "",
        markdown_table(["case", "max abs output / input-gradient difference", "max abs gradient difference",
                        "after 3 AdamW steps", "choices dropped"], rows, "lrrrr"), "",
        f"All-to-all bytes of one forward and backward (16 tokens per rank, top-2, balanced routing): "
        f"{formula.message_bytes} per rank, counted = formula on every rank.", "",
        f"The tiny mixture GPT-2, top-1, Zipf-distributed tokens, {len(steps)} steps:", "",
        markdown_table(["balancing α", "busiest expert / mean (first -> last step)", "busiest rank / mean (last)",
                        "rows per rank (last step)", "median ms per step"], load, "rrrrr")])
