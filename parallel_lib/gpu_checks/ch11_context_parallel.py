"""Chapter 11's GPU check: ring and Ulysses attention on NCCL ranks equal full attention; GPT-2 with ring attention
equals the dense model; PyTorch's own context parallelism beside them; memory and time per rank by length.

:mod:`parallel_lib.gpu_checks` registers :func:`check_context_parallel` as ``context_parallel``. On a
CPU PyTorch's ``context_parallel`` refuses (its SDPA dispatch has no rule for the CPU kernel, see
:func:`parallel_lib.context_parallel.verify.torch_context_parallel_check`); on GPUs it runs, and
this check is where the two are compared on the same inputs: PyTorch's output against SDPA in one
process and against our zig-zag ring attention's.
"""

from __future__ import annotations

from typing import Any

from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.runtime.launcher import launch

__all__ = ["cp_sizes", "pytorch_beside_ours", "check_context_parallel"]

TOLERANCE = 1e-4   # fp32 attention in tiles against the whole score matrix: float noise is ~1e-6


def cp_sizes(n_devices: int, quick: bool = False) -> list[int]:
    """The cp sizes to check on ``n_devices``: 2, 4, 8 up to the devices (quick: the largest only)."""
    sizes = [c for c in (2, 4, 8) if c <= n_devices]
    return sizes[-1:] if quick else sizes


def pytorch_beside_ours(cp: int, gpt2: float, found: list[dict]) -> list[Any]:
    """The table row of PyTorch's context parallelism beside ours, from every rank's
    :func:`~parallel_lib.context_parallel.verify.torch_context_parallel_check`.

    Returns:
        ``[cp, GPT-2's difference, our ring's from SDPA, what PyTorch's did]``.

    Raises:
        CheckError: our ring attention differs from SDPA, or PyTorch's ran and differs from SDPA or from ours.
    """
    def worst(key: str) -> float:   # NaN counts as the largest (max() would skip it)
        return max((f[key] for f in found), key=lambda x: (x != x, x))

    ours = worst("ours")
    if not ours < TOLERANCE:   # NaN fails too
        raise CheckError(f"our ring attention (zig-zag) at cp={cp} differs from SDPA by {ours:.3g}")
    if not found[0]["ran"]:
        return [cp, f"{gpt2:.1e}", f"{ours:.1e}", f"refused: {found[0]['error'][:160]}"]
    sdpa, beside = worst("output"), worst("beside_ours")
    if not (sdpa < TOLERANCE and beside < TOLERANCE):
        raise CheckError(f"PyTorch's context_parallel at cp={cp} differs from SDPA by {sdpa:.3g} and from our ring "
                         f"attention by {beside:.3g}")
    return [cp, f"{gpt2:.1e}", f"{ours:.1e}", f"ran: {sdpa:.1e} from SDPA, {beside:.1e} from ours"]


def check_context_parallel(n_gpus: int, quick: bool = False) -> str:
    """Chapter 11: exactness of ring (both layouts, causal and not) and Ulysses at each cp, GPT-2 with ring
    attention, PyTorch's ``context_parallel`` on the same inputs, and the measured memory and time per rank.

    Raises:
        CheckError: an output or gradient differs from full attention, bytes sent or kept differ from the
            formulas, GPT-2 differs from the dense model, our ring attention differs from SDPA on PyTorch's
            inputs, or PyTorch's context parallelism ran and differs from SDPA or from ours.
    """
    from parallel_lib.context_parallel.cost import attention_saved_bytes, cp_wire_bytes
    from parallel_lib.context_parallel.measure import Shape, measure_on_ranks, rank_rows
    from parallel_lib.context_parallel.verify import (Case, attention_check, gpt2_check, several,
                                                      torch_context_parallel_check)

    heads = 8
    cases = [Case("ring", causal, layout, heads=heads, seq_len=32 if quick else 1024, head_dim=8 if quick else 64,
                  block=8 if quick else 128) for causal in (False, True) for layout in ("contiguous", "zigzag")]
    cases += [Case("ulysses", True, layout, heads=heads, seq_len=cases[0].seq_len, head_dim=cases[0].head_dim,
                   block=cases[0].block) for layout in ("contiguous", "zigzag")]
    shape = Shape(heads=4, head_dim=8, block=8, repeats=1) if quick else Shape(heads=8, head_dim=64, block=128)
    lengths = [32] if quick else [1024, 2048, 4096]
    rows, measured, beside = [], [], []
    for cp in cp_sizes(n_gpus, quick):
        jobs = [(attention_check, (cases,)), (gpt2_check, (("zigzag",) if quick else ("contiguous", "zigzag"),)),
                (torch_context_parallel_check, (64,)), (measure_on_ranks, (lengths, shape))]
        results = launch(several, cp, jobs, timeout=600)
        for case_index, case in enumerate(cases):
            found = [r[0][case_index] for r in results]
            worst = max(max(f["errors"].values()) for f in found)
            wire = cp_wire_bytes(case.method, case.batch, case.heads, case.seq_len, case.head_dim, cp)
            kept = attention_saved_bytes(case.method, case.batch, case.heads, case.seq_len, case.head_dim, cp=cp)
            if not worst < TOLERANCE:   # NaN fails too
                raise CheckError(f"{case.method} ({case.layout}, causal={case.causal}) at cp={cp} differs from full "
                                 f"attention by {worst:.3g}")
            for rank, f in enumerate(found):
                if (f["forward_bytes"], f["backward_bytes"], f["saved_bytes"]) != (wire.forward, wire.backward, kept):
                    raise CheckError(f"{case.method} ({case.layout}) at cp={cp}, rank {rank}: sent "
                                     f"{f['forward_bytes']}+{f['backward_bytes']} bytes and kept {f['saved_bytes']}, "
                                     f"the formulas say {wire.forward}+{wire.backward} and {kept}")
            entries = [f["work"]["entries"] for f in found]
            rows.append([cp, case.method, case.layout, "yes" if case.causal else "no", f"{worst:.1e}",
                         "equal", f"{max(entries) / min(entries):.2f} : 1"])
        gpt2 = max(max(errors.values()) for r in results for errors in r[1].values())
        if not gpt2 < TOLERANCE:
            raise CheckError(f"GPT-2 with ring attention at cp={cp} differs from the dense model by {gpt2:.3g}")
        beside.append(pytorch_beside_ours(cp, gpt2, [r[2] for r in results]))
        for row in rank_rows([r[3] for r in results], cp):
            measured.append([row["method"], row["layout"], cp, row["seq_len"], f"{max(row['saved_bytes']) / 1024:,.1f}",
                             f"{max(row['seconds']) * 1e3:,.1f}"])
    case = cases[0]
    return "\n".join([
        f"Context parallelism on {n_gpus} ranks ({launch.__module__} picks NCCL with a GPU per rank): every rank's "
        f"output and q, k, v gradients against the same shard of full attention (b 1, {case.heads} heads x "
        f"{case.head_dim}, sequence {case.seq_len}, fp32); bytes sent and kept against the formulas:", "",
        markdown_table(["cp", "method", "layout", "causal", "max abs difference", "sent and kept vs formula",
                        "work largest : smallest rank"], rows, "rlllrlr"), "",
        "GPT-2 (tiny) with ring attention against the dense model (logits, loss, cp-summed gradients); on the "
        "same inputs (1 x 2 heads x 64 tokens x 8, causal), our zig-zag ring attention and PyTorch's "
        "torch.distributed.tensor.experimental.context_parallel around SDPA, each against SDPA in one process "
        "and against each other (max abs difference of the whole output):", "",
        markdown_table(["cp", "GPT-2 max abs difference", "our ring vs SDPA", "PyTorch's context_parallel"], beside,
                       "rrrl"), "",
        f"Memory kept for backward per rank (census) and forward + backward time (causal, {shape.heads} heads x "
        f"{shape.head_dim}, tiles of {shape.block}, slowest rank):", "",
        markdown_table(["method", "layout", "cp", "sequence", "kept KiB/rank", "fwd+bwd ms"], measured, "lllrrr")])
