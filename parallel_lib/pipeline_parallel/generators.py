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
of the weights: nobody waits, so W can be put off into what would be idle time). The memory a
schedule may hold decides how much idle time W can fill:

- ZB-H1, the paper's hand-drawn order (:func:`zb_h1`): 1F1B's peak memory, bubble ``(p-1)/(3m)`` with equal costs;
- ZB-H2: every rank holds at most 2p - 1 micro-batches (about twice 1F1B); no bubble inside any rank's span.
  Built as the paper's heuristic builds it (:func:`greedy_zero_bubble`): replay with unit costs, each
  free rank runs a ready B, else a forward under its memory limit, else its oldest pending W;
- ZB-V, the paper's V schedule (:func:`zbv`): two stages per rank in a V (rank r holds stages r and
  2p-1-r), each rank at most 2p half-stage activations (p micro-batches, 1F1B's first rank's peak) and
  no bubble for ``m >= 2p-1`` with equal costs. The authors' comparison (README of
  sail-sg/zero-bubble-pipeline-parallelism, T_F = T_B = T_W): bubble 1F1B (p-1)/m, ZB-H1 (p-1)/(3m),
  ZB-H2 0, ZB-V 0; activation memory 1x, 1x, 2x, 1x of 1F1B; pipeline communication 1x, 1x, 1x, 2x.

DualPipeV, the other V schedule, is in :mod:`parallel_lib.pipeline_parallel.dualpipe`.
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
    """ZB-V, the zero-bubble paper's V schedule (Qi et al. 2024, section 6; ``ScheduleZBVZeroBubble``'s order).

    Rank r holds model stages ``r`` (down the V) and ``2p-1-r`` (back up). Its list, built for
    ``n = max(m, 2p-1)`` micro-batches and then stripped of every action on a micro-batch ``>= m``:

    1. warm-up: ``2(p-r)-1`` forwards on the first stage, then r pairs (second stage, first stage):
       rank r starts half a stage after rank r-1, and its second stage's first input comes back
       up the V exactly when the pairs end;
    2. ``p-r`` times F, B, W on the second stage: its backward starts at once (the loss is on rank 0);
    3. steady state: F, B, W on the first stage, then F, B, W on the second, until the forwards run out;
    4. cool-down: r pairs of B (first stage, second stage) with their W put off, then ``p-r`` times
       B then the oldest W on the first stage, then the put-off W: second stage first, then first.

    Zero bubble needs equal F, B and W costs and ``m >= 2p-1``: then no rank idles inside its
    span (a parallelogram of half-stage steps: the whole step is ``(p-1)/(6m)`` longer than the
    ideal when each step starts cold). Every rank holds at most 2p half-stage activations, p
    micro-batches of its whole share: 1F1B's first rank's peak (the paper's ``p·M_B``), on every rank.
    """
    _check_sizes(p, m)
    n = max(m, 2 * p - 1)
    ranks = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        f = {down: 0, up: 0}  # next micro-batch per stage and kind
        b = {down: 0, up: 0}
        put_off: list[Action] = []  # weight gradients of the cool-down's B, run last
        actions: list[Action] = []

        def run(kind: str, s: int, weight: bool = True, later: bool = False) -> None:
            counter = f if kind == "F" else b
            actions.append(Action(kind, counter[s], s))  # type: ignore[arg-type]
            if kind == "B" and weight:
                actions.append(Action("W", counter[s], s))
            elif kind == "B" and later:
                put_off.append(Action("W", counter[s], s))
            counter[s] += 1

        for _ in range(2 * (p - r) - 1):
            run("F", down)
        for _ in range(r):
            run("F", up)
            run("F", down)
        for _ in range(p - r):
            run("F", up)
            run("B", up)
        while f[down] < n or f[up] < f[down]:
            if f[down] < n:
                run("F", down)
            run("B", down)
            run("F", up)
            run("B", up)
        for _ in range(r):
            run("B", down, weight=False, later=True)
            run("B", up, weight=False, later=True)
        for _ in range(p - r):  # B on the first stage, then its oldest put-off W
            run("B", down, weight=False, later=True)
            oldest = min((a for a in put_off if a.stage == down), key=lambda a: a.micro_batch)
            put_off.remove(oldest)
            actions.append(oldest)
        actions += sorted(put_off, key=lambda a: (a.stage != up, a.micro_batch))
        ranks.append(tuple(a for a in actions if a.micro_batch < m))
    return Schedule("zbv", p, m, tuple(ranks), v_placement(p))


register_schedule("interleaved", interleaved_1f1b, virtual=2)
register_schedule("zb-h1", zb_h1)
register_schedule("zb-h2", zb_h2)
register_schedule("zbv", zbv, virtual=2)

from parallel_lib.pipeline_parallel import dualpipe as _dualpipe  # noqa: E402,F401  (registers "dualpipev")
