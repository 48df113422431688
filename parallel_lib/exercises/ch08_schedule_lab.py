"""Chapter 08's schedule lab: write a pipeline schedule that meets a bubble and a memory target.

The student writes every rank's actions (``"F0 F1 B0 W0 ..."``, the library's schedule format)
for costs that are not the ones the library's schedules were drawn for: W costs twice B. Under
them ZB-H1 keeps too much idle time and ZB-H2 holds too many micro-batches, so printing a
built-in schedule does not pass. The checker runs what a cluster run would meet, in order:

1. the validator (every action once, F before B before W, no dependency cycle);
2. the NCCL blocking check on the exchanges the process engine would post (paired with the
   neighbouring action's, or in rounds where pairing would hang: ``link.plan_exchanges``);
3. the simulator with the lab's costs: bubble and peak micro-batches held per rank;
4. the threaded ``Pipe`` running the schedule itself, every gradient compared with the unsplit model's.

The typical wrong answers are recognised by name (a backward before its forward, a W before its
B, an unsplit backward, ranks waiting on each other, a built-in schedule pasted in, a schedule
that meets the bubble but not the memory target), each with a hint that says where to look,
not what to write. The reference answer is in ``solutions.py`` (``SCHEDULE_LAB``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import nn

from parallel_lib.exercises._core import CheckResult, failed, passed
from parallel_lib.pipeline_parallel.generators import greedy_zero_bubble
from parallel_lib.pipeline_parallel.link import find_deadlock, plan_exchanges
from parallel_lib.pipeline_parallel.pipe import Pipe
from parallel_lib.pipeline_parallel.schedule import ALL_SCHEDULES, Action, Schedule, make_schedule
from parallel_lib.pipeline_parallel.simulator import SimResult, simulate_schedule, validate_schedule

__all__ = ["P", "M", "COSTS", "BUBBLE_TARGET", "PEAK_LIMIT", "SCHEDULE_LAB_STUB", "as_lab_schedule",
           "check_schedule_lab"]

P, M = 4, 8                 # ranks, micro-batches
COSTS = (1.0, 1.0, 2.0)     # F, B, W of one micro-batch on one rank: W twice B (the library draws F = B = W)
BUBBLE_TARGET = 0.07        # ZB-H1 reaches 3/32 ~ 0.094 under COSTS
PEAK_LIMIT = 5              # micro-batches held per rank (F done, W not yet); ZB-H2 holds 2p - 1 = 7
_NAME = "schedule_lab"
_WORD = re.compile(r"^([FBW])(\d+)(?:s(\d+))?$")
_PREFIX = re.compile(r"^\s*(stage|rank)\s*\d+\s*:")  # a row copied from print(schedule)

SCHEDULE_LAB_STUB = f'''\
# p = {P} ranks, m = {M} micro-batches, one model stage per rank. Measured costs of one micro-batch
# on every rank: F = {COSTS[0]:g}, B = {COSTS[1]:g} (input gradient), W = {COSTS[2]:g} (weight gradient).
# Targets: bubble <= {BUBBLE_TARGET} (simulate_schedule(...).bubble) with at most {PEAK_LIMIT} micro-batches held
# by any rank (F done, W not yet). Write each rank's actions in order, as in print(make_schedule(...)):
# one string per rank such as "F0 F1 B0 W0 ..." (a Schedule, or lists of Action, work too).
# To see yours: render_schedule(as_lab_schedule(schedule_lab), stage_costs=COSTS), with
# from parallel_lib.exercises.ch08_schedule_lab import COSTS, as_lab_schedule
schedule_lab = None  # your answer: [rank 0's actions, rank 1's, rank 2's, rank 3's]
'''


def _as_action(word: Any) -> Action:
    if isinstance(word, Action):
        return word
    found = _WORD.match(str(word).strip().upper().replace("S", "s")) if isinstance(word, str) else None
    if not found:
        raise ValueError(f'actions written like "F0", "B3" or "W7" (kind, then micro-batch), got {word!r}')
    kind, i, s = found.groups()
    return Action(kind, int(i), None if s is None else int(s))  # type: ignore[arg-type]


def as_lab_schedule(answer: Any) -> Schedule:
    """The student's answer as a :class:`Schedule` of the lab's size.

    Raises:
        TypeError: not a Schedule, nor a list with one entry (a string or a list of actions) per rank.
        ValueError: an action that does not parse, another number of ranks or micro-batches, or a rank
            that holds several model stages.
    """
    if isinstance(answer, Schedule):
        schedule = answer
    elif isinstance(answer, (list, tuple)) and all(isinstance(row, (str, list, tuple)) for row in answer):
        rows = [_PREFIX.sub("", row).split() if isinstance(row, str) else list(row) for row in answer]
        stages = tuple(tuple(_as_action(word) for word in row) for row in rows)
        numbers = [a.micro_batch for row in stages for a in row]
        schedule = Schedule("yours", len(stages), 1 + max(numbers) if numbers else 0, stages)
    else:
        raise TypeError(f"a list of {P} strings, one per rank, such as \"F0 F1 B0 W0 ...\" (or a Schedule), "
                        f"not a {type(answer).__name__}")
    if schedule.placement != tuple(range(schedule.num_stages)):
        raise ValueError(f"one model stage per rank (the lab's model is cut into {P} stages), got the placement "
                         f"{schedule.placement} (stage s on rank placement[s])")
    if schedule.num_stages != P or schedule.num_micro_batches != M:
        raise ValueError(f"{P} ranks and micro-batches 0..{M - 1}, got {schedule.num_stages} rank(s) and "
                         f"{schedule.num_micro_batches} micro-batch(es)")
    return schedule


def _library_twin(schedule: Schedule) -> Optional[str]:
    """The name of the library's schedule ``schedule`` equals (its actions rank by rank), if any."""
    make_schedule("gpipe", 1, 1)  # registers every name
    candidates = {name: lambda n=name: make_schedule(n, P, M) for name in ALL_SCHEDULES}
    candidates.update({f"greedy_zero_bubble with a limit of {limit}":
                       lambda limit=limit: greedy_zero_bubble("greedy", P, M, range(P), [limit] * P)
                       for limit in range(P, 2 * P)})
    for name, build in candidates.items():
        try:
            twin = build()
        except ValueError:  # a schedule that cannot run P, M
            continue
        if twin.stages == schedule.stages and twin.placement == schedule.placement:
            return name
    return None


def _validation_problem(schedule: Schedule) -> Optional[tuple[str, str]]:
    """(problem, hint) when the validator refuses the schedule, the mistake named; None if it accepts it."""
    try:
        validate_schedule(schedule)
    except ValueError as error:
        text = str(error)
        before = re.search(r"stage (\d+) runs ([BW])(\d+)\S* before ([FB])", text)
        if before and before.group(2) == "B":
            return (f"a backward before its forward: rank {before.group(1)} runs B{before.group(3)} before "
                    f"F{before.group(3)}",
                    "B differentiates what F computed on this rank; move that micro-batch's B after its F")
        if before:
            return (f"a weight gradient before its input gradient: rank {before.group(1)} runs W{before.group(3)} "
                    f"before B{before.group(3)}",
                    "W needs the output gradient that B receives from the next rank; a W may wait, never lead")
        if "deadlocks" in text:
            return ("the ranks wait on each other (a dependency cycle): " + text.split("deadlocks: ")[-1],
                    "follow one micro-batch: F on rank r needs F on rank r-1 first, B on rank r needs B on "
                    "rank r+1 first; find the two ranks whose next actions each wait for the other's")
        return text, f"every rank runs F, B and W of each micro-batch 0..{M - 1} exactly once"
    return None


def _where_idle(result: SimResult) -> str:
    """The longest wait inside a rank's span of work, on the rank with the most idle time, between which actions."""
    def name(event: Any) -> str:
        kind = "F" if event.kind == "forward" else "W" if event.label.startswith("W") else "B"
        return f"{kind}{event.micro_batch}"

    idle, gaps = [], []
    for j in range(P):
        lane = sorted((e for e in result.events if e.lane == f"stage {j}"), key=lambda e: e.start)
        idle.append(lane[-1].end - lane[0].start - result.busy[j])
        gaps.append(max(((b.start - a.end, a, b) for a, b in zip(lane, lane[1:])), key=lambda g: g[0]))
    worst = max(range(P), key=lambda j: idle[j])
    wait, before, after = gaps[worst]
    return (f"rank {worst} idles {idle[worst]:g} time units inside its span, the longest wait {wait:g} between "
            f"{name(before)} and {name(after)}")


def _mlp() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):  # leave the notebook's random state alone
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(P)])


def _pipe_problem(schedule: Schedule) -> Optional[str]:
    """Run the schedule on a threaded Pipe; what differs from the unsplit model's gradients, or None."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        x, y = torch.randn(2 * M, 16), torch.randn(2 * M, 16)
    reference = _mlp()
    nn.functional.mse_loss(reference(x), y).backward()
    model = _mlp()
    with Pipe(model, ["cpu"] * P, chunks=M, schedule=schedule, timeout=30.0) as pipe:
        pipe.train_step(x, y, nn.functional.mse_loss)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        if param.grad is None or not torch.allclose(param.grad, expected.grad, rtol=1e-5, atol=1e-6):
            return f"on the Pipe the gradient of {name} differs from the unsplit model's"
    return None


def check_schedule_lab(answer: Any) -> CheckResult:
    """Validator, NCCL blocking check, simulator with the lab's costs, then the Pipe against the unsplit model."""
    if answer is None or answer is Ellipsis:
        return failed(_NAME, None, f"{_NAME} is not answered yet (it is still {answer!r})")
    try:
        schedule = as_lab_schedule(answer)
    except (TypeError, ValueError) as error:
        return failed(_NAME, None, f"the answer must be {error}")
    twin = _library_twin(schedule)
    if twin is not None:
        result = simulate_schedule(schedule, COSTS if schedule.split_backward else (COSTS[0], COSTS[1] + COSTS[2]))
        return failed(_NAME, None, f"this is the library's {twin}, pasted in: with these costs its bubble is "
                      f"{result.bubble:.3f} and it holds up to {max(result.peak_in_flight):g} micro-batches",
                      "it was drawn for F = B = W; simulate it with COSTS and look at where each rank waits")
    problem = _validation_problem(schedule)
    if problem is not None:
        return failed(_NAME, None, *problem)
    if not schedule.split_backward:
        return failed(_NAME, None, "the backward is not split: no rank runs a W",
                      "an unsplit backward leaves the drain's idle time empty; split each B and W and let W wait")
    try:  # what the process engine would post over NCCL, where every large message waits for its partner
        plan_exchanges(schedule)
    except ValueError as error:
        return failed(_NAME, None, f"the exchanges would hang over NCCL: {error}",
                      "without tags the k-th tensor sent on a channel is the k-th received: keep each rank's "
                      "receives in the order its neighbour sends")
    exchanges = ("paired" if find_deadlock(schedule, paired=True, sender_order=True) is None
                 else "in rounds (paired ones would hang)")
    result = simulate_schedule(schedule, COSTS)
    peak, bubble = max(result.peak_in_flight), result.bubble
    if peak > PEAK_LIMIT and bubble <= BUBBLE_TARGET:
        return failed(_NAME, None, f"meets the bubble ({bubble:.3f} <= {BUBBLE_TARGET}) but not the memory target: "
                      f"ranks hold {result.peak_in_flight} micro-batches, the limit is {PEAK_LIMIT}",
                      "each forward run before the last W is done holds one more micro-batch: which ranks "
                      "need that many, and where could a W run earlier?")
    if bubble > BUBBLE_TARGET:
        over = f"; and ranks hold {result.peak_in_flight}, above {PEAK_LIMIT}" if peak > PEAK_LIMIT else ""
        return failed(_NAME, None, f"the bubble is {bubble:.3f}, above the target {BUBBLE_TARGET}{over}",
                      f"{_where_idle(result)}: what could that rank run there that it is already allowed to?")
    try:
        difference = _pipe_problem(schedule)
    except Exception as error:  # a stage that raised or timed out: reported, never a traceback in the cell
        difference = f"on the Pipe the schedule raised {type(error).__name__}: {error}"
    if difference is not None:
        return failed(_NAME, None, difference)
    return passed(_NAME, f"bubble {bubble:.3f} <= {BUBBLE_TARGET} at {peak:g} <= {PEAK_LIMIT} micro-batches; over "
                  f"NCCL the exchanges run {exchanges} without a hang; on the Pipe every gradient equals the "
                  f"unsplit model's")
