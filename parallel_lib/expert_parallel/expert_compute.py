"""Running a rank's experts on the rows sent to them: one matrix multiply per expert, or one grouped multiply.

After the dispatch a rank holds ``N`` rows, each for one of its ``E_local`` experts. The
plain way loops: gather expert ``e``'s rows, run its MLP, put the results back. That is
``2 · E_local`` matrix multiplies of different sizes, and on a GPU each is a kernel launch
of its own: with DeepSeek-V3's 256 experts over a few ranks, launch latency and small,
badly-shaped multiplies dominate. A grouped multiply does every expert's multiply in one
call: here the rows are sorted by expert and padded to the busiest expert's count, the
experts' weights stacked, and ``torch.baddbmm`` runs all experts at once (the padding is
computed and thrown away; a real grouped GEMM such as CUTLASS's, or ``torch._grouped_mm`` on
recent GPUs, skips it). Both give the same rows (to rounding): :func:`run_experts` picks one
by name, and :func:`time_expert_compute` measures them.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.common.checks import check_choice, positive_int

__all__ = ["EXPERT_COMPUTE", "run_experts", "time_expert_compute"]

EXPERT_COMPUTE = ("loop", "grouped")


def _loop(experts: Sequence[nn.Module], rows: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(rows)
    for i, expert in enumerate(experts):
        mine = torch.nonzero(expert_of_row == i, as_tuple=True)[0]
        # an expert with no rows still runs (on none): the result then depends on every expert's weights,
        # so every rank's backward reaches the reverse all-to-all, even a rank that received nothing
        out = out.index_add(0, mine, expert(rows[mine]))
    return out


def _grouped(experts: Sequence[nn.Module], rows: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    n_experts = len(experts)
    counts = torch.bincount(expert_of_row, minlength=n_experts)                        # (E,)
    order = torch.argsort(expert_of_row, stable=True)                                  # rows by expert
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.shape[0], device=rows.device) - start.repeat_interleave(counts)  # place in its expert
    width = int(counts.max()) if rows.shape[0] else 0
    padded = rows.new_zeros(n_experts, width, rows.shape[1])                           # (E, n_max, h)
    padded = padded.index_put((expert_of_row[order], slot), rows[order])
    w_fc = torch.stack([e.c_fc.weight for e in experts])                               # (E, h, inner)
    b_fc = torch.stack([e.c_fc.bias for e in experts])[:, None, :]                     # (E, 1, inner)
    w_proj = torch.stack([e.c_proj.weight for e in experts])                           # (E, inner, h)
    b_proj = torch.stack([e.c_proj.bias for e in experts])[:, None, :]                 # (E, 1, h)
    hidden = F.gelu(torch.baddbmm(b_fc, padded, w_fc), approximate="tanh")             # (E, n_max, inner)
    done = torch.baddbmm(b_proj, hidden, w_proj)                                       # (E, n_max, h)
    return torch.zeros_like(rows).index_copy(0, order, done[expert_of_row[order], slot])


def run_experts(experts: Sequence[nn.Module], rows: torch.Tensor, expert_of_row: torch.Tensor,
                how: str = "loop") -> torch.Tensor:
    """Each row through its expert: ``out[i] = experts[expert_of_row[i]](rows[i])``.

    Args:
        experts: the rank's experts (:class:`~.expert.Expert`).
        rows: (N, h) rows.
        expert_of_row: (N,) int64 index into ``experts`` of each row.
        how: "loop" (one multiply per expert) or "grouped" (one batched multiply for all).

    Raises:
        ValueError: an unknown ``how``, or ``expert_of_row`` not one index per row.
    """
    check_choice("how", how, EXPERT_COMPUTE)
    if expert_of_row.shape != rows.shape[:1]:
        raise ValueError(f"expert_of_row must hold one expert per row ({rows.shape[0]}), got shape "
                         f"{tuple(expert_of_row.shape)}")
    return (_loop if how == "loop" else _grouped)(experts, rows, expert_of_row)


def time_expert_compute(n_experts: int = 8, tokens: int = 4096, hidden: int = 256, repeat: int = 5,
                        seed: int = 0, device: str = "cpu") -> dict[str, float]:
    """Median seconds of a forward and backward of ``n_experts`` GPT-2 experts on ``tokens`` rows, both ways.

    A benchmark (not a test): routing is uniform at random, widths ``hidden -> 4·hidden -> hidden``.
    On a GPU (``device="cuda"``) each timing waits for the device's kernels to finish.

    Raises:
        ValueError: a count below 1.
    """
    from parallel_lib.expert_parallel.expert import Expert

    for name, value in (("n_experts", n_experts), ("tokens", tokens), ("hidden", hidden), ("repeat", repeat)):
        positive_int(name, value)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        experts = nn.ModuleList(Expert(hidden, 4 * hidden) for _ in range(n_experts))
        for p in experts.parameters():
            nn.init.normal_(p, 0.0, 0.02)
    experts = experts.to(device)
    rows = torch.randn(tokens, hidden, generator=generator).to(device)
    expert_of_row = torch.randint(0, n_experts, (tokens,), generator=generator).to(device)
    wait = torch.cuda.synchronize if rows.is_cuda else (lambda: None)
    times: dict[str, float] = {}
    for how in EXPERT_COMPUTE:
        spent = []
        for _ in range(repeat + 1):  # the first is a warm-up
            wait()
            start = time.perf_counter()
            run_experts(experts, rows, expert_of_row, how).sum().backward()
            wait()
            spent.append(time.perf_counter() - start)
        times[how] = sorted(spent[1:])[len(spent[1:]) // 2]
    return times
