"""Chapter 06's exercise on clipping by the global norm when every rank holds a shard of the gradient, on gloo ranks.

``torch.nn.utils.clip_grad_norm_`` scales the whole gradient by ``max_norm / (norm + 1e-6)`` when its L2
norm exceeds ``max_norm``. Under ZeRO-2 no rank holds the whole gradient: each holds a shard of the
mean gradient, and the classic bug (shipped by more than one sharded trainer) is to clip each shard
by its own norm, which changes the direction of the update and, with several ranks, never clips
when no shard alone exceeds the limit.

The checker ships the student's function to ``_WORLD`` gloo ranks and trains a small MLP with the
library's :class:`~parallel_lib.sharding.zero.ZeroEngine` at stage 2 (each parameter its own flat
group, so ``reduced_gradient`` hands out this rank's shards), twice in one launch: once with the
engine's own ``clip_grad_norm_`` (the reference), once with the student's function in its place.
``max_norm`` is chosen per step from the gradient the rank holds, so that the steps separate the
mistakes:

- step 1: above every shard's own norm and below the global norm (only a global clip clips);
- step 2: half the smallest shard's norm (everything is clipped, each by its own factor if wrong);
- step 3: twice the global norm (nothing may change).

From the shards before and after the call the checker reads the factor each rank applied and
names the norm it must have used: its own shard's, the sum of the ranks' norms (a square root taken
before the all-reduce), the mean of the squares, the largest shard's, the squares without a root;
a factor above 1, one per tensor, no change. Then the returned norm, then the parameters after
the 3 steps against the reference run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, stub_result
from parallel_lib.exercises._ranks import case_error, run_on_ranks
from parallel_lib.exercises.ch06_zero2 import _batch, _mlp
from parallel_lib.sharding.zero import ZeroEngine

__all__ = ["CLIP_STUB", "check_clip_grad_norm_sharded", "check_clip_grad_norm_sharded_many"]

CLIP_STUB = '''\
import torch
import torch.distributed as dist


def clip_grad_norm_sharded(shards, max_norm):
    """Clip by the global norm when each rank holds only shards of the (already averaged) gradient.

    shards: a list of tensors, this rank's shards of the parameters' mean gradient (ZeRO-2); the shards
    of all ranks together are the whole gradient, each element on exactly one rank (padding holds zeros).
    Scale the shards in place exactly as torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scales the whole gradient in one process (by max_norm / (norm + 1e-6), only when that is below 1),
    and return the whole gradient's norm before clipping, the same on every rank.
    Use torch.distributed on the default group, and import everything inside this function: the
    checker ships its source to 2 gloo ranks.
    """
    ...  # your code here
'''

_WORLD, _STEPS = 2, 3
_ENGINE = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1)
_EPS = 1e-6  # torch's clip_grad_norm_ adds it to the norm


def _max_norm(step: int, total: float, norms: list[float]) -> float:
    """The step's max_norm from the global norm and every rank's own shard norm (see the module docstring)."""
    if step == 0:
        return (max(norms) + total) / 2
    if step == 1:
        return min(norms) / 2
    return 2 * total


def _train(rank: int, world_size: int, clip: Optional[Callable[..., Any]], label: str) -> dict[str, Any]:
    """``_STEPS`` ZeRO-2 steps of the MLP, clipped by ``clip`` (None: the engine's own clip_grad_norm_)."""
    model = _mlp()
    params = list(model.parameters())
    engine = ZeroEngine(model, stage=2, separate=params, **_ENGINE)
    steps = []
    for k in range(_STEPS):
        x, y = _batch(k, rank)
        F.mse_loss(model(x), y).backward()
        engine.reduce_gradients()
        shards = [engine.reduced_gradient(p) for p in params]  # views: clipping edits the engine's gradient
        before = [s.detach().clone().double() for s in shards]
        squares = torch.tensor([float(sum(s.pow(2).sum() for s in before))] * world_size, dtype=torch.float64)
        mask = torch.zeros(world_size, dtype=torch.float64)
        mask[rank] = 1.0
        squares *= mask
        dist.all_reduce(squares)  # every rank's own squared norm, on every rank (the checker's collective)
        norms = squares.sqrt().tolist()
        max_norm = _max_norm(k, math.sqrt(sum(squares.tolist())), norms)
        try:
            norm = engine.clip_grad_norm_(max_norm) if clip is None else clip(shards, max_norm)
            norm = float(norm)
        except Exception as error:
            raise case_error(f"{label}step {k + 1}", error) from error
        steps.append({"before": before, "after": [s.detach().clone().double() for s in shards], "norm": norm,
                      "max_norm": max_norm, "norms": norms})
        engine.step()
    state = {name: t.detach().clone() for name, t in engine.full_state_dict().items()}
    engine.remove()
    return {"steps": steps, "state": state}


def _clip_rank(rank: int, world_size: int, answers: Any) -> dict[str, Any]:
    """Worker: the reference run with the engine's clip, then every answer in turn."""
    several = isinstance(answers, tuple)
    reference = _train(rank, world_size, None, "")
    runs = [_train(rank, world_size, shipped.load(), f"answer {index}, " if several else "")
            for index, shipped in enumerate(answers if several else (answers,))]
    return {"reference": reference, "answers": runs}


# ----------------------------------------------------------------------------- naming the norm that was used

# (the named mistake, hint, the factor it applies: f(global norm, every rank's norm, max_norm, rank))
_Factor = Callable[[float, list[float], float, int], float]
_CLIPPED: list[tuple[str, str, _Factor]] = [
    ("the gradient was not changed (the shards must be scaled in place)",
     "clip_grad_norm_ edits the gradient it is given; a new tensor bound to a local name edits nothing",
     lambda g, n, m, r: 1.0),
    ("each shard was clipped by its own norm: the squared norms were not summed across the ranks",
     "the limit is on the norm of the whole gradient, and no rank holds all of it; in step 1 no shard alone "
     "exceeds max_norm, the whole gradient does",
     lambda g, n, m, r: min(1.0, m / (n[r] + _EPS))),
    ("the ranks' norms were added: the square root was taken before the all-reduce",
     "norms do not add up; what does add up over disjoint pieces of a vector?",
     lambda g, n, m, r: min(1.0, m / (sum(n) + _EPS))),
    ("the squares were averaged over the ranks instead of summed",
     "the shards are disjoint pieces of one gradient, not copies of it",
     lambda g, n, m, r: min(1.0, m / (math.sqrt(sum(x * x for x in n) / len(n)) + _EPS))),
    ("the largest shard's norm was used (an all-reduce with MAX)",
     "the whole gradient's norm counts every shard",
     lambda g, n, m, r: min(1.0, m / (max(n) + _EPS))),
    ("the squared norm was used: the square root is missing", "the L2 norm is the root of the sum of squares",
     lambda g, n, m, r: min(1.0, m / (g * g + _EPS))),
    ("the gradient was scaled up although its norm is below max_norm",
     "clipping only ever shrinks a gradient", lambda g, n, m, r: m / (g + _EPS)),
]


def _expected(g: float, n: list[float], m: float, r: int) -> float:
    return min(1.0, m / (g + _EPS))


def _factors(step: dict[str, Any]) -> tuple[Optional[float], bool]:
    """(the one factor this rank's shards were scaled by, or None; whether each tensor had a factor of its own)."""
    before = torch.cat([t.reshape(-1) for t in step["before"]])
    after = torch.cat([t.reshape(-1) for t in step["after"]])
    if after.shape != before.shape:
        return None, False
    factor = float(after @ before / (before @ before))
    if torch.allclose(after, factor * before, rtol=1e-5, atol=1e-9 * float(before.abs().max())):
        return factor, False
    per_tensor = [float(a.reshape(-1) @ b.reshape(-1) / (b.reshape(-1) @ b.reshape(-1)))
                  for a, b in zip(step["after"], step["before"]) if float(b.abs().max()) > 0]
    return None, all(torch.allclose(a, f * b, rtol=1e-5) for a, b, f in zip(step["after"], step["before"], per_tensor))


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-9)


def _diagnose(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> Optional[tuple[str, str, str]]:
    """(case, named mistake, hint) for one answer's runs on every rank, or None when it is right."""
    factors: list[list[float]] = []  # [step][rank]
    for k in range(_STEPS):
        row = []
        for rank, run in enumerate(ranks):
            factor, per_tensor = _factors(run["steps"][k])
            if factor is None:
                if per_tensor:
                    return (f"step {k + 1}", f"rank {rank} scaled each tensor by a factor of its own: each was "
                            "clipped by its own norm", "one factor for the whole gradient, from its global norm")
                return (f"step {k + 1}", f"rank {rank}'s shards were not scaled by one factor",
                        "clipping multiplies the whole gradient by one number")
            row.append(factor)
        factors.append(row)

    def matches(rule: _Factor) -> bool:
        return all(_same(factors[k][r], rule(math.sqrt(sum(x * x for x in step["norms"])), step["norms"],
                                             step["max_norm"], r))
                   for r, run in enumerate(ranks) for k, step in enumerate(run["steps"]))

    if not matches(_expected):
        for what, hint, rule in _CLIPPED:
            if matches(rule):
                return "3 steps", what, hint
        k, r = next((k, r) for k in range(_STEPS) for r in range(_WORLD)
                    if not _same(factors[k][r], _expected(math.sqrt(sum(x * x for x in ranks[r]["steps"][k]["norms"])),
                                                          ranks[r]["steps"][k]["norms"],
                                                          ranks[r]["steps"][k]["max_norm"], r)))
        return (f"step {k + 1}", f"rank {r} scaled its shards by {factors[k][r]:.6g}", "max_norm / (norm + 1e-6), "
                "at most 1, where norm is the whole gradient's L2 norm")
    for k in range(_STEPS):
        for r, run in enumerate(ranks):
            step = run["steps"][k]
            total = math.sqrt(sum(x * x for x in step["norms"]))
            if _same(step["norm"], total):
                continue
            if _same(step["norm"], step["norms"][r]):
                what = "the norm returned is this rank's shard's, not the whole gradient's"
            elif _same(step["norm"], min(total, step["max_norm"])):
                what = "the norm returned is the norm after clipping"
            else:
                what = f"the norm returned is {step['norm']:.6g}, the whole gradient's norm was {total:.6g}"
            return (f"step {k + 1}", f"rank {r}: {what}", "return the global norm before clipping, as torch does "
                    "(a training log plots it)")
    mine, theirs = ranks[0]["state"], reference["state"]
    worst = max(float((mine[name] - theirs[name]).abs().max()) for name in theirs)
    if worst > 1e-6:
        return ("3 steps", f"after 3 steps the parameters differ from ZeroEngine.clip_grad_norm_'s by up to "
                f"{worst:.3g}",
                "scale the shards themselves, in place, and nothing else")
    return None


def check_clip_grad_norm_sharded_many(answers: list[Any]) -> list[CheckResult]:
    """Check several ``clip_grad_norm_sharded`` answers in one launch of ``_WORLD`` gloo ranks (a test's answers).

    Returns:
        One :class:`CheckResult` per answer (the same failure for all when the launch fails).
    """
    name = "clip_grad_norm_sharded"
    for fn in answers:
        require_callable(fn, name)
    todo = [k for k, fn in enumerate(answers) if not is_stub(fn)]
    results: list[CheckResult] = [stub_result(name, name)] * len(answers)
    if not todo:
        return results
    records = run_on_ranks(name, [answers[k] for k in todo], _clip_rank, _WORLD, crash_hint=_crash_hint)
    if isinstance(records, CheckResult):
        return [records if k in todo else results[k] for k in range(len(answers))]
    for position, k in enumerate(todo):
        problem = _diagnose([records[r]["answers"][position] for r in range(_WORLD)], records[0]["reference"])
        results[k] = failed(name, *problem) if problem else passed(
            name, f"{_STEPS} ZeRO-2 steps on {_WORLD} gloo ranks, clipped as ZeroEngine.clip_grad_norm_ clips "
            "(global norm above every shard's, below the smallest, and no clipping needed)")
    return results


def check_clip_grad_norm_sharded(fn: Any) -> CheckResult:
    """Check ``clip_grad_norm_sharded`` on 2 gloo ranks against ``ZeroEngine.clip_grad_norm_``, 3 steps."""
    require_callable(fn, "clip_grad_norm_sharded")
    return check_clip_grad_norm_sharded_many([fn])[0]


def _crash_hint(message: str) -> str:
    if "NameError" in message:
        return "the ranks run only the source of clip_grad_norm_sharded: import everything inside it"
    if "a leaf Variable" in message or "in-place" in message:
        return "the shards are gradients: scale them with mul_ under no autograd"
    return ""
