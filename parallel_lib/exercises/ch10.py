"""Exercises for chapter 10: choose a layout for a budget and justify it with the planner's predictions,
and find which term makes a layout run out of memory (and the smallest ZeRO stage that cures it).

Both are checked against the planner itself (:func:`parallel_lib.planner.search.plan_layouts` and
:func:`parallel_lib.planner.layout.price` with the published A100 figures), never against a typed number.
"""

from __future__ import annotations

from functools import lru_cache
from numbers import Integral
from typing import Any, Optional

from parallel_lib.exercises._core import CheckResult, Exercise, failed, passed
from parallel_lib.planner.hardware import GPUS, published_calibration
from parallel_lib.planner.layout import Layout, Priced, StepCost, price
from parallel_lib.planner.search import LayoutPlan, plan_layouts
from parallel_lib.sharding.memory import zero_memory
from parallel_lib.tensor_parallel.cost import GPTShape

__all__ = ["check_choose_layout", "check_oom_term", "EXERCISES", "CHOOSE_SOLUTION", "OOM_SOLUTION",
           "CHOOSE_JOB", "OOM_JOB"]

# the Llama-style 8B shape of parallel_lib.planner.published (sequence 4096), on A100 80 GB nodes of 8
SHAPE, SEQ, GPU = GPTShape(32, 4096, 32, 128256, 4096), 4096, "A100"
CHOOSE_JOB = dict(devices=32, global_batch=128)
OOM_JOB = dict(layout=Layout(dp=8, zero=0, micro_batches=4, dtype="bf16"), global_batch=32)
SLACK = 1.10  # a layout within 10 % of the planner's fastest is as good a choice as the model can tell

CHOOSE_STUB = '''\
# Budget: 32 A100 80 GB (4 nodes of 8, published figures), a Llama-style 8B model (32 blocks, width 4096,
# 32 heads, vocabulary 128,256), 128 sequences of 4096 tokens per step, bf16 mixed precision.
# Choose a layout: dp x tp x pp = 32 and a ZeRO stage. Use the planner (plan_layouts / price, or the
# widget's functions) to justify it by its predicted memory and step time: it must fit, and be within
# 10 % of the fastest layout the planner finds. Write in a comment WHY it beats its neighbours.
CHOSEN_LAYOUT = None  # your answer: dict(dp=..., tp=..., pp=..., zero=...)
'''

OOM_STUB = '''\
# Plain data parallelism (ZeRO-0) of the same 8B model on 8 A100 80 GB, 32 sequences of 4096 tokens per
# step in 4 micro-batches per rank, bf16 mixed-precision AdamW, runs out of memory. Which term of the
# busiest rank's memory is the largest: "parameters", "gradients", "optimizer" or "activations"?
# And which is the LOWEST ZeRO stage (1, 2 or 3) with which the same job fits?
OOM_ANSWER = None  # your answer: (term, zero stage), e.g. ("gradients", 3)
'''

# reference answers (the checkers never read them: they ask the planner; tests check they pass)
CHOOSE_SOLUTION = dict(dp=32, tp=1, pp=1, zero=3)  # FSDP-style: its gathers hide behind compute (price's overlap)
OOM_SOLUTION = ("optimizer", 1)


def _calibration_and_cost() -> tuple[Any, StepCost, float]:
    gpu = GPUS[GPU]
    return published_calibration(GPU), StepCost(0.0, gpu.flops_bf16), gpu.memory_gb * 1e9


@lru_cache(maxsize=1)
def _choose_plan() -> LayoutPlan:
    calibration, cost, memory = _calibration_and_cost()
    return plan_layouts(SHAPE, CHOOSE_JOB["devices"], memory, CHOOSE_JOB["global_batch"], SEQ, calibration, cost,
                        dtype="bf16", schedules=("1f1b", "interleaved"), max_pp=16)


def _grid(c: Any) -> tuple[int, int, int, int]:
    return (c.layout.dp, c.layout.tp, c.layout.pp, c.layout.zero if c.layout.dp > 1 else 0)


def _as_grid(answer: Any) -> tuple[int, int, int, int]:
    if not isinstance(answer, dict) or not {"dp", "tp", "pp"} <= set(answer):
        raise TypeError("a dict with keys dp, tp, pp (and zero), e.g. dict(dp=8, tp=2, pp=2, zero=1)")
    for k in ("dp", "tp", "pp", "zero"):  # int(nan) raised its own words, int(2.5) and True passed as 2 and 1
        v = answer.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"whole numbers, got {k}={v!r}; e.g. dict(dp=8, tp=2, pp=2, zero=1)")
    values = tuple(int(answer.get(k, 0)) for k in ("dp", "tp", "pp", "zero"))
    if any(v < 1 for v in values[:3]) or values[3] not in (0, 1, 2, 3):
        raise ValueError("dp, tp, pp positive whole numbers and zero one of 0, 1, 2, 3")
    return values[0], values[1], values[2], values[3] if values[0] > 1 else 0


def check_choose_layout(answer: Any) -> CheckResult:
    """The layout must fit and its best variant (schedule, SP, recompute, micro-batches) be within 10 % of the best."""
    name = "choose_layout"
    if answer is None or answer is Ellipsis:
        return failed(name, None, "CHOSEN_LAYOUT is not answered yet (it is still None)")
    try:
        dp, tp, pp, zero = _as_grid(answer)
    except (TypeError, ValueError) as error:
        return failed(name, None, f"CHOSEN_LAYOUT must be {error}")
    devices = CHOOSE_JOB["devices"]
    if dp * tp * pp != devices:
        return failed(name, None, f"dp·tp·pp = {dp * tp * pp}, but the budget is {devices} GPUs",
                      "use every GPU: an idle GPU is bought and not used")
    if tp > 8:
        return failed(name, None, f"tp = {tp} spans more than one node of 8 GPUs",
                      "tensor parallelism all-reduces activations 4 times per block and micro-batch: it must stay "
                      "on NVLink, inside a node")
    plan = _choose_plan()
    best = plan.best
    assert best is not None and best.priced is not None
    mine = [c for c in plan.ranked if _grid(c) == (dp, tp, pp, zero)]
    if not mine:
        why = [c.why_not for c in plan.rejected if _grid(c) == (dp, tp, pp, zero)]
        return failed(name, None, f"DP{dp}×TP{tp}×PP{pp} ZeRO-{zero} does not fit in any variant the planner tries: "
                      f"{why[0] if why else 'the batch or the model does not split that way'}",
                      "look at which term is over the card: model state calls for ZeRO or more tp/pp, "
                      "activations for recomputation or more micro-batches")
    ours = mine[0].priced
    assert ours is not None
    ratio = ours.step_seconds / best.priced.step_seconds
    if ratio > SLACK:
        return failed(name, None, f"it fits, but its fastest variant ({mine[0].layout.name}) is predicted at "
                      f"{ours.step_seconds:.3f} s per step, {ratio - 1:.0%} slower than the best the planner finds",
                      _slower_hint(ours, best.priced))
    return passed(name, f"{mine[0].layout.name}: {ours.memory_bytes / 2**30:.1f} GiB, {ours.step_seconds:.3f} s "
                  f"per step ({ratio - 1:+.1%} against the planner's best)")


def _slower_hint(ours: Priced, best: Priced) -> str:
    """Name the term where the chosen layout loses most against the best."""
    terms = {"the pipeline bubble": ours.compute * ours.bubble - best.compute * best.bubble,
             "the tensor-parallel all-reduces": ours.tp_comm - best.tp_comm,
             "the data-parallel (ZeRO) collectives": ours.dp_comm - best.dp_comm,
             "compute (recomputation or an unbalanced stage)": (ours.compute - ours.tp_comm) -
             (best.compute - best.tp_comm)}
    worst = max(terms, key=terms.__getitem__)
    return f"compare the predicted terms: yours loses most in {worst}"


def _oom_terms(zero: int) -> tuple[Priced, dict[str, float]]:
    calibration, cost, _ = _calibration_and_cost()
    layout = Layout(**{**OOM_JOB["layout"].__dict__, "zero": zero})
    p = price(layout, SHAPE, OOM_JOB["global_batch"], SEQ, calibration, cost)
    state = zero_memory(p.params, layout.dp, zero, "bf16")
    return p, {"parameters": state["params"], "gradients": state["grads"], "optimizer": state["optimizer"],
               "activations": p.activation_bytes}


def _oom_reference() -> tuple[str, int]:
    _, terms = _oom_terms(0)
    memory = _calibration_and_cost()[2]
    lowest = next(z for z in (1, 2, 3) if _oom_terms(z)[0].memory_bytes <= memory)
    return max(terms, key=terms.__getitem__), lowest


_ALIASES = {"params": "parameters", "parameter": "parameters", "weights": "parameters", "grads": "gradients",
            "gradient": "gradients", "optimizer states": "optimizer", "optimizer state": "optimizer",
            "adam": "optimizer", "activation": "activations"}


def _term(value: Any) -> Optional[str]:
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    text = _ALIASES.get(text, text)
    return text if text in ("parameters", "gradients", "optimizer", "activations") else None


def check_oom_term(answer: Any) -> CheckResult:
    """The ZeRO-0 layout's largest memory term and the lowest ZeRO stage that fits, from the planner's own sums."""
    name = "oom_term"
    if answer is None or answer is Ellipsis:
        return failed(name, None, "OOM_ANSWER is not answered yet (it is still None)")
    if isinstance(answer, (str, bytes)) or not hasattr(answer, "__len__") or len(answer) != 2:
        return failed(name, None, 'OOM_ANSWER must be a pair (term, zero stage), e.g. ("gradients", 3)')
    term, stage = _term(answer[0]), answer[1]
    if term is None:
        return failed(name, None, f"the term {answer[0]!r} is none of parameters, gradients, optimizer, activations")
    want_term, want_stage = _oom_reference()
    _, terms = _oom_terms(0)
    gib = {k: f"{v / 2**30:.1f} GiB" for k, v in terms.items()}
    if term != want_term:
        hints = {"activations": "4 micro-batches run one after another: only one micro-batch's activations are held "
                                "at a time; count the bytes per parameter of mixed-precision AdamW",
                 "parameters": "bf16 parameters are 2 bytes each; the fp32 master copy belongs to the optimizer's "
                               "12 bytes per parameter (ZeRO paper's K = 12)",
                 "gradients": "bf16 gradients are 2 bytes per parameter; what keeps 12?"}
        return failed(name, None, f"the largest term is not {term!r} (it holds {gib[term]})", hints.get(term, ""))
    try:
        stage = int(stage)
    except (TypeError, ValueError):
        return failed(name, None, f"the ZeRO stage must be 1, 2 or 3, got {stage!r}")
    if stage != want_stage:
        fits = _oom_terms(stage)[0].memory_bytes <= _calibration_and_cost()[2] if stage in (1, 2, 3) else False
        hint = (f"ZeRO-{stage} fits too, but a lower stage already does, with less traffic (ZeRO-3 gathers the "
                "parameters again for every forward and backward)" if fits else
                f"with ZeRO-{stage} the busiest rank still holds more than the card: shard more of the state")
        return failed(name, None, f"ZeRO-{stage} is not the lowest stage that fits", hint)
    return passed(name, f"{term} ({gib[term]} at ZeRO-0); ZeRO-{stage} is the lowest stage that fits")


EXERCISES = [
    Exercise("choose_layout", check_choose_layout, CHOOSE_STUB, CHOOSE_SOLUTION,
             "Choose a layout for 32 A100s and justify it by the planner's predicted memory and step time."),
    Exercise("oom_term", check_oom_term, OOM_STUB, OOM_SOLUTION,
             "Find which term makes plain data parallelism run out of memory, and the ZeRO stage that cures it."),
]
