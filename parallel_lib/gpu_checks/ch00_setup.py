"""Chapter 00's GPU check: ranks on NCCL sum a tensor, and the tiny GPT-2 trains on ``cuda:0``.

:mod:`parallel_lib.gpu_checks` registers :func:`check_setup` as ``setup``.
"""

from __future__ import annotations

import torch

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.device import resolve_device
from parallel_lib.runtime.launcher import launch

__all__ = ["check_setup"]


def check_setup(n_gpus: int, quick: bool = False) -> str:
    """Chapter 00: an all-reduce over ``n_gpus`` NCCL ranks, then the tiny GPT-2's first run on one GPU."""
    from parallel_lib.quickstart import tiny_run
    from parallel_lib.runtime.environment import all_reduce_demo

    per_rank = launch(all_reduce_demo, n_gpus, timeout=120) if n_gpus > 1 else []
    expected = n_gpus * (n_gpus + 1) / 2
    for rank, _, after in per_rank:
        if not torch.equal(after, torch.full((2,), expected)):
            raise CheckError(f"rank {rank}: all-reduce gave {after.tolist()}, expected {expected} everywhere")
    steps = 10 if quick else 40
    record = tiny_run(steps=steps, device=resolve_device(0))
    if not record.final_loss < record.losses[0]:
        raise CheckError(f"the tiny GPT-2 did not learn on {resolve_device(0)}: loss {record.losses[0]:.2f} -> "
                         f"{record.final_loss:.2f}")
    rows = [["all-reduce of [rank + 1] (NCCL on GPUs)", f"{n_gpus} ranks",
             f"{expected:g} on every rank" if per_rank else "skipped: one GPU"],
            [f"tiny GPT-2, {steps} steps", str(resolve_device(0)),
             f"loss {record.losses[0]:.2f} -> {record.final_loss:.2f}, {record.throughput(skip=2):,.0f} tokens/s"]]
    return "\n".join(["Set-up (chapter 00):", "", markdown_table(["run", "where", "result"], rows, "lll")])
