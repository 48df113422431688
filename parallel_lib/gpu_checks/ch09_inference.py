"""The GPU check of chapter 09: serving on ``cuda:N`` and NCCL ranks gives the CPU's tokens.

:func:`check_inference` runs the single engine on ``cuda:0`` and model parallelism over
``cuda:0..n-1`` in this process, then data, pipeline and tensor parallelism on NCCL ranks
(one launch), and compares every request's tokens with the single engine on the CPU;
:mod:`parallel_lib.gpu_checks` registers it.
"""

from __future__ import annotations

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError, free_memory
from parallel_lib.inference import Engine, Request, ServeConfig, serve_many

__all__ = ["check_inference"]


def _requests(quick: bool) -> list[Request]:
    new = 6 if quick else 24
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [40, 41, 42], [60] * 20]
    return [Request(p, new) for p in prompts] + [Request([5, 6, 7], new, temperature=1.0, seed=3)]


def check_inference(n_gpus: int, quick: bool = False) -> str:
    """Chapter 09: the engine on cuda:0, mp over cuda:0..n-1, and dp/pp/tp on NCCL ranks give the CPU engine's tokens.

    dp, pp and tp run on min(n_gpus, 4) ranks (the tiny model has 4 layers and 4 heads); tp on 2 where
    its 4 heads do not split over that many.
    """
    config = ServeConfig(initializer_range=0.3, max_batch=4)
    requests = _requests(quick)
    model = config.build()
    cpu = Engine.single(model, max_batch=config.max_batch).generate(requests)
    expected = [r.tokens for r in cpu]
    runs = serve_many(requests, ["single", "mp"], min(n_gpus, model.config.n_layer), config)  # int keys: cuda:k
    ranks = min(n_gpus, model.config.n_layer)
    if ranks >= 2:
        ranked = ["dp", "pp", "tp"] if model.config.n_head % ranks == 0 else ["dp", "pp"]
        # backend "auto": NCCL with a GPU per rank (gloo for an --allow-cpu run)
        runs.update(serve_many(requests, ranked, ranks, config, timeout=300))
        if "tp" not in runs:
            runs.update(serve_many(requests, ["tp"], 2, config, timeout=300))
    free_memory()
    rows = []
    for name, run in runs.items():
        same = sum(got == want for got, want in zip(run.tokens, expected))
        if same != len(expected):
            raise CheckError(f"{name} on {run.world_size} GPU(s): {len(expected) - same} of {len(expected)} requests "
                             f"got other tokens than the CPU engine: {run.tokens} vs {expected}")
        ok = [r for r in run.results if r.ok]
        rows.append([name, run.world_size, f"{same}/{len(expected)}", f"{run.tokens_per_second():,.0f}",
                     f"{1e3 * max(r.ttft for r in ok):.1f}", f"{1e3 * max(r.tpot for r in ok):.2f}",
                     f"{max(rank.kv_bytes for rank in run.ranks) / 2**20:.2f}"])
    return "\n".join([f"Serving the tiny GPT-2 on {n_gpus} GPU(s): every strategy's tokens equal the CPU engine's "
                      f"({len(requests)} requests, greedy and seeded sampling):", "",
                      markdown_table(["strategy", "GPUs / ranks", "same tokens as CPU", "tokens/s", "TTFT ms (worst)",
                                      "TPOT ms (worst)", "KV MiB per device"], rows, "lrrrrrr")])
