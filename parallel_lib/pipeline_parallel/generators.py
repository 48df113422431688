"""Chapter 08's schedules: interleaved 1F1B, zero-bubble ZB-H1 and ZB-H2, and the V schedule ZBV.

Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's ``forward_backward_pipelining_with_interleaving``):
the model is cut into p·v stages, stage s on rank ``s % p``, so a micro-batch visits every rank
v times and the fill and drain shrink v-fold: bubble ``(p-1)/(v·m)``. Rank r runs
``(p-r-1)·2 + (v-1)·p`` warm-up forwards, then one forward / one backward, then the rest of the
backwards, taking micro-batches in groups of p per model chunk. Requirement (Megatron-LM before
v0.7): ``m`` a multiple of p, so every group is full (an m < p cannot fill the first group:
the hang gallery shows it deadlock).

Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward is
split into B (gradient of the stage's input: the previous stage waits for it) and W (gradient
of the weights: nobody waits, so W can be put off into what would be idle time). They are
built here as the paper's heuristic builds them: replay the pipeline with equal unit costs
and let each rank, when free, run a ready B, else a forward if it holds fewer than its limit
of micro-batches, else its oldest pending W. The limit is the memory the schedule is allowed:

- ZB-H1 is the paper's hand-drawn order (:func:`zb_h1`): 1F1B's peak memory, bubble ``(p-1)/(3m)`` with equal costs;
- ZB-H2: every rank holds at most 2p - 1 micro-batches (about twice 1F1B); no bubble inside any rank's span;
- ZBV: two stages per rank in a V (rank r holds stages r and 2p-1-r), each rank at most 2p stage-activations,
  i.e. p micro-batches of its whole share, the memory of 1F1B's first rank.
"""

from __future__ import annotations

from typing import Sequence

from parallel_lib.pipeline_parallel.schedule import (
    Action,
    Schedule,
    _check_sizes,
    action_ready,
    loop_placement,
    register_schedule,
    v_placement,
)

__all__ = ["interleaved_1f1b", "zb_h1", "zb_h2", "zbv", "greedy_zero_bubble", "check_interleaved_m",
           "megatron_interleaved_order"]


def check_interleaved_m(p: int, m: int) -> None:
    """Interleaved 1F1B's requirement on m: a multiple of p (ValueError naming m otherwise)."""
    _check_sizes(p, m)
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m, the number of micro-batches, to be a multiple of p={p} "
                         f"(groups of p per model chunk), got m={m}; use m={p * max(1, round(m / p))}")


def megatron_interleaved_order(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved order without checking m (the hang gallery calls it with m < p)."""
    total = m * v  # forward "virtual micro-batches" per rank

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def micro_batch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    ranks = []
    for r in range(p):
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)  # m == p: all forwards first

        def forward(k: int) -> Action:
            return Action("F", micro_batch(k), chunk(k, True) * p + r)

        def backward(k: int) -> Action:
            return Action("B", micro_batch(k), chunk(k, False) * p + r)

        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):  # steady state
            actions += [forward(k + warmup), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        ranks.append(tuple(actions))
    return Schedule("interleaved", p, m, tuple(ranks), loop_placement(p, v))


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B with v model stages per rank (see the module docstring).

    Raises:
        ValueError: p, m or v below 1, or m not a multiple of p.
    """
    _check_sizes(p, m)
    _check_sizes(v, 1) if v >= 1 else _check_sizes(1, v)
    check_interleaved_m(p, m)
    return megatron_interleaved_order(p, m, v)


def greedy_zero_bubble(name: str, p: int, m: int, placement: Sequence[int], limits: Sequence[float]) -> Schedule:
    """Per-rank orders from a unit-cost replay: a ready B first, else F under the rank's limit, else W.

    Args:
        limits: per rank, the most stage-activations it may hold (F begun, W not done).
    """
    _check_sizes(p, m)
    place = tuple(placement)
    n = len(place)
    mine = [[s for s in range(n) if place[s] == r] for r in range(p)]
    schedule = Schedule(name, p, m, tuple(() for _ in range(p)), place)  # for action_ready's stage lookup
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, i) -> tick it finished
    orders: list[list[Action]] = [[] for _ in range(p)]
    next_f = [[0] * n for _ in range(p)]  # next micro-batch to forward per stage
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    held = [0] * p
    total, tick = 3 * n * m, 0
    while len(done) < total:
        started = []
        finished = {key for key, t in done.items() if t <= tick}
        for r in range(p):
            if orders[r] and _busy(orders[r][-1], done, tick):
                continue  # still running its last action
            ready_b = [Action("B", i, s) for s in mine[r] for i in range(m)
                       if ("B", s, i) not in done and action_ready(schedule, r, Action("B", i, s), finished)]
            ready_f = [Action("F", next_f[r][s], s) for s in mine[r] if next_f[r][s] < m
                       and action_ready(schedule, r, Action("F", next_f[r][s], s), finished)]
            if ready_b:  # the previous stage waits for it: oldest micro-batch, then the later stage
                action = min(ready_b, key=lambda a: (a.micro_batch, -a.stage))  # type: ignore[operator]
                pending_w[r].append(Action("W", action.micro_batch, action.stage))
            elif ready_f and held[r] < limits[r]:  # the stage further along first: it frees memory sooner
                action = max(ready_f, key=lambda a: (a.stage, -a.micro_batch))  # type: ignore[operator]
                next_f[r][action.stage] += 1  # type: ignore[index]
                held[r] += 1
            elif pending_w[r]:  # nothing else to do: the oldest weight gradient fills the gap
                action = pending_w[r].pop(0)
                held[r] -= 1
            else:
                continue
            started.append((r, action))
        for r, action in started:
            orders[r].append(action)
            done[(action.kind, action.stage, action.micro_batch)] = tick + 1  # type: ignore[index]
        tick += 1
        if tick > 10 * total + 10:
            raise ValueError(f"{name}: no schedule found for p={p}, m={m} with limits {list(limits)}")
    if place == tuple(range(p)):  # one stage per rank: actions name no stage, like GPipe's and 1F1B's
        orders = [[Action(a.kind, a.micro_batch) for a in order] for order in orders]
    return Schedule(name, p, m, tuple(tuple(order) for order in orders), place)


def _busy(action: Action, done: dict[tuple[str, int, int], int], tick: int) -> bool:
    return done[(action.kind, action.stage, action.micro_batch)] > tick  # type: ignore[index]


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1, as Qi et al. draw it (and ``torch.distributed.pipelining`` builds it for one stage per rank).

    Rank r runs 1F1B's ``p-1-r`` warm-up forwards, then F, B pairs, and puts off its first r
    weight gradients: from then on each pair is followed by the oldest pending W, and the
    put-off W fill the cool-down, where 1F1B waits. Every rank holds at most p micro-batches
    (1F1B's peak, on every rank instead of the first); bubble ``(p-1)/(3m)`` with equal F, B, W.
    """
    _check_sizes(p, m)
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [Action("F", i) for i in range(warmup)]
        waiting: list[int] = []  # micro-batches whose W is put off
        for i in range(m):
            if warmup + i < m:
                actions.append(Action("F", warmup + i))
            actions.append(Action("B", i))
            waiting.append(i)
            if len(waiting) > r:
                actions.append(Action("W", waiting.pop(0)))
        actions += [Action("W", i) for i in waiting]
        ranks.append(tuple(actions))
    return Schedule("zb-h1", p, m, tuple(ranks))


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2: every rank may hold 2p - 1 micro-batches; extra warm-up forwards fill the start.

    Built by :func:`greedy_zero_bubble`; with equal F, B, W no rank idles inside its own span
    (a parallelogram: rank r starts r ticks late and ends r ticks late).
    """
    return greedy_zero_bubble("zb-h2", p, m, tuple(range(p)), [2 * p - 1] * p)


def zbv(p: int, m: int) -> Schedule:
    """ZBV: two stages per rank in a V, each rank at most 2p stage-activations (p micro-batches).

    The greedy order at this memory leaves a small bubble (0.0625 for p=4, m=8 with equal costs);
    the paper's hand-drawn ZB-V reaches 0 (see the comparison with ``torch.distributed.pipelining``).
    """
    return greedy_zero_bubble("zbv", p, m, v_placement(p), [2 * p] * p)


register_schedule("interleaved", interleaved_1f1b, virtual=2)
register_schedule("zb-h1", zb_h1)
register_schedule("zb-h2", zb_h2)
register_schedule("zbv", zbv, virtual=2)
