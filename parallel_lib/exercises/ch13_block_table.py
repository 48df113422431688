"""Chapter 13's block-table exercise: where in the paged pool a sequence's token lives, checked on a real run.

The checker first calls the student's lookup on small tables (out of order, as the block manager
hands blocks out) and compares with the library's :func:`~parallel_lib.serving.paged_kv_cache.slots_of`;
a wrong answer is named there by matching the typical mistakes (the position used as the slot, the
block number not scaled to slots, block and offset swapped, one block off, the block without its
offset). An answer that agrees is then used where it belongs: the walkthrough's requests are served
by the engine until its pool is full and some tables are out of order, and for every running
sequence the student's slots gather layer 0's keys from the engine's pool. Those must be the keys of
the sequence's own tokens, computed afresh from each token and its position (layer 0's keys depend
on nothing else), exactly what the engine's attention reads through the same table.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from parallel_lib.exercises._core import (CheckResult, as_int, failed, is_stub, passed, require_callable, show,
                                          stub_result)
from parallel_lib.serving.paged_kv_cache import slots_of

__all__ = ["SLOT_STUB", "check_block_slot", "RUN_STEPS"]

SLOT_STUB = '''\
def block_slot(table, block_size, position):
    """The slot of the paged pool that holds token ``position`` (0, 1, ...) of a sequence.

    table: the sequence's block table, the pool's block numbers in token order (not necessarily ascending:
    the block manager hands out whichever blocks are free); block_size: token slots per block. The pool's
    slots are numbered block after block: block b holds slots b * block_size .. (b + 1) * block_size - 1.
    Return the slot, an int.
    """
    ...  # your code here
'''

# (table, block_size, position): in order, easy first; the identity table last (there a slot is its position)
_CASES = (([5, 2], 4, 0), ([5, 2], 4, 3), ([5, 2], 4, 4), ([5, 2], 4, 6), ([3, 0, 7], 2, 5), ([9], 16, 15),
          ([4, 1, 0, 6], 3, 10), ([0, 1, 2], 4, 9))
RUN_STEPS = 9  # steps of the walkthrough served before the keys are gathered (its pool is full, tables out of order)

# the typical wrong answers: (what it computes, what it is called, the hint)
_WRONG: tuple[tuple[Callable[[list, int, int], int], str, str], ...] = (
    (lambda t, b, p: p // b * b + p % b, "the position used as the slot: no table lookup",
     "position // block_size is the block's index in the table, not its number in the pool: a sequence's "
     "blocks are wherever the block manager found free ones, so look the number up in the table"),
    (lambda t, b, p: t[p // b], "the block, not the slot",
     "that is the block number; the slot is inside it: its first slot is block * block_size, then the offset"),
    (lambda t, b, p: t[p // b] + p % b, "the block number not scaled to slots",
     "table[...] numbers blocks; block b's first slot is b * block_size"),
    (lambda t, b, p: t[p % b] * b + p // b, "block index and offset swapped",
     "the block index counts the whole blocks before the position (//), the offset is what is left (%)"),
    (lambda t, b, p: t[p // b + 1] * b + p % b, "one block too far",
     "positions and table entries both count from 0: position 0 is in the table's first block"),
    (lambda t, b, p: t[(p + 1) // b] * b + (p + 1) % b, "one position too far",
     "positions count from 0: position block_size - 1 is the last slot of the first block"),
)


def _wrong_name(fn: Callable, failing: tuple) -> tuple[str, str]:
    """(name, hint) of the typical mistake that gives what ``fn`` gave on every case; ("", "") if none does."""
    for wrong, name, hint in _WRONG:
        agree = True
        for case in _CASES:
            try:
                want = wrong(*case)
            except IndexError:
                want = None
            try:
                got = fn(list(case[0]), case[1], case[2])
            except Exception:  # noqa: BLE001 - the student's code; compared, never raised
                got = None
            if want != got:
                agree = False
                break
        if agree:
            return name, hint
    for wrong, name, hint in _WRONG:  # not on every case: the mistake that explains the failing one
        try:
            if wrong(*failing) == fn(list(failing[0]), failing[1], failing[2]):
                return name, hint
        except Exception:  # noqa: BLE001
            continue
    return "", ""


def _fresh_keys(model: Any, tokens: list[int]) -> torch.Tensor:
    """Layer 0's keys of ``tokens`` at positions 0.. computed without any cache: (len, heads, head_dim)."""
    body, block = model.transformer, model.transformer.h[0]
    ids = torch.tensor(tokens, device=body.wte.weight.device)
    x = body.wte(ids) + body.wpe.weight[: len(tokens)]
    k = block.attn.c_attn(block.ln_1(x)).chunk(3, dim=-1)[1]
    return k.view(len(tokens), model.config.n_head, -1)


def _run_check(fn: Callable) -> tuple[Optional[str], str]:
    """Gather every running sequence's keys from a real engine's pool through ``fn``; (problem or None, summary)."""
    from parallel_lib.serving.engine import ServingEngine
    from parallel_lib.serving.walkthrough import walkthrough_model, walkthrough_requests

    engine = ServingEngine(walkthrough_model(), num_blocks=6, block_size=4, max_batch=4)
    for request in walkthrough_requests():
        engine.add(request)
    with torch.no_grad():
        for _ in range(RUN_STEPS):
            engine.step()
        pool = engine.cache.k[0]
        tables = []
        for seq in sorted(engine.scheduler.running, key=lambda s: s.id):
            table, n = engine.blocks.table(seq.id), seq.computed
            tables.append(f"r{seq.id}: {table}")
            label = f"the engine after {RUN_STEPS} steps, request {seq.id} (table {table}, {n} tokens in the pool)"
            try:
                mine = [as_int(fn(list(table), engine.block_size, t)) for t in range(n)]
            except Exception as error:  # noqa: BLE001 - the student's code, reported with its case
                return f"case {label}: raised {type(error).__name__}: {error}", ""
            if any(not 0 <= s < pool.shape[0] for s in mine):
                return f"case {label}: slots {show(mine, 120)} are outside the pool's 0..{pool.shape[0] - 1}", ""
            gathered = pool[mine]                                           # (n, heads, head_dim)
            if not torch.allclose(gathered, _fresh_keys(engine.model, seq.tokens[:n]), atol=1e-5, rtol=1e-4):
                want = slots_of(table, 0, n, engine.block_size)
                return (f"case {label}: the keys gathered at your slots {show(mine, 120)} are not the keys of its "
                        f"tokens (the engine reads slots {show(want, 120)})"), ""
    return None, f"its slots gathered the keys of {len(tables)} running sequences from the engine's pool after " \
                 f"{RUN_STEPS} steps ({'; '.join(tables)}), each equal to its tokens' keys computed afresh"


def check_block_slot(fn: Any) -> CheckResult:
    """Small tables against :func:`slots_of`, then a gather of keys through the answer on a real engine run."""
    name = "block_slot"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    for case in _CASES:
        table, block_size, position = case
        label = f"block_slot({list(table)}, {block_size}, {position})"
        want = slots_of(table, position, position + 1, block_size)[0]
        try:
            got = fn(list(table), block_size, position)
        except Exception as error:  # noqa: BLE001 - the student's code, reported with its case
            wrong, hint = _wrong_name(fn, case)
            return failed(name, label, f"raised {type(error).__name__}: {error}", hint)
        if got is None:
            return failed(name, label, "returned None: the function is not written yet, or it forgets to `return`")
        try:
            got = as_int(got)
        except TypeError as error:
            return failed(name, label, f"returned {show(got, 80)}, but the slot must be {error}")
        if got != want:
            wrong, hint = _wrong_name(fn, case)
            what = f" ({wrong})" if wrong else ""
            return failed(name, label, f"expected slot {want}, got {got}{what}", hint)
    problem, summary = _run_check(fn)
    if problem is not None:
        return failed(name, None, problem, "the slots must hold for every position of every table, long tables and "
                      "tables out of order included")
    return passed(name, f"{len(_CASES)} cases; {summary}")
