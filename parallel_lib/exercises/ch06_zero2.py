"""Chapter 06's exercise on a ZeRO-2 step written from reduce-scatter and all-gather, run on gloo ranks.

The student writes the rank's side of ZeRO-2 on one flat parameter buffer (the library's
:class:`~parallel_lib.sharding.flat.FlatParamGroup`, whose views the model computes with): set up
this rank's shard and an AdamW over it, then, per step, turn this rank's gradient into its shard
of the mean gradient, update the shard, and bring every rank's updated shard back into the
buffer. The checker ships the function to ``_WORLD`` gloo ranks, trains a small MLP ``_STEPS``
steps on each rank's own batch, and compares in the notebook's process with one process running
AdamW on the whole batch. What each rank records lets the typical mistakes be named, in this order:

1. the optimizer: AdamW built over the whole buffer keeps the states of every element (the
   parameters were updated whole, not this rank's shard);
2. the collectives (:func:`~parallel_lib.runtime.collectives.count_collectives`): an all-reduce of
   the gradient is data parallelism's (and ZeRO-1's) exchange, which leaves every rank the whole
   reduced gradient; more bytes than a reduce-scatter and an all-gather is another waste;
3. the gradient AdamW saw at the first step (a step pre-hook): N times the mean (not divided by the
   world size), this rank's own gradient (not reduced), another rank's shard;
4. the buffer after the first step: unchanged (gathered before the update), or only this rank's shard new;
5. anything else: the parameters after every step against one process.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.cost.alpha_beta import ring_wire_bytes
from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, stub_result
from parallel_lib.exercises._ranks import case_error, run_on_ranks
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.sharding.flat import FlatParamGroup, padded_numel

__all__ = ["ZERO2_STUB", "check_zero2_step", "check_zero2_steps"]

ZERO2_STUB = '''\
import torch
import torch.distributed as dist


def zero2_rank(flat_params, make_optimizer):
    """ZeRO-2 on this rank: set up, then return the function that makes one training step.

    flat_params: (P,) float32, every trainable parameter in one flat buffer, P a multiple of the world
    size N, the same on every rank. The model computes with it: a step must leave the new parameters in
    it (in place). Rank r owns the shard flat_params[r * P // N : (r + 1) * P // N].
    make_optimizer(tensors) returns AdamW (the checker's hyper-parameters) over a list of tensors.

    Return step(flat_grad), where flat_grad (P,) is this rank's gradient of its own micro-batch (the
    mean over its samples). After step(flat_grad), flat_params must hold what one process holds after
    AdamW on the mean gradient over all ranks, while this rank keeps optimizer states and a reduced
    gradient for its own shard only. Use reduce_scatter_single and all_gather_single from
    parallel_lib.runtime.compat (torch's one-tensor collectives, by whichever name this torch gives them)
    on the default group, and define everything inside this function: the checker ships its source to
    2 gloo ranks.
    """
    ...  # your code here
'''

_WORLD, _STEPS, _SAMPLES = 2, 3, 4
_SIZES = (6, 8, 3)                            # the MLP: 6 -> 8 -> 3, 83 parameters (padded to 84 on 2 ranks)
_ADAMW = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1)  # eps large: the gradient's scale shows
_TOL = 1e-5


def _mlp() -> nn.Sequential:
    """The model, the same in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        return nn.Sequential(nn.Linear(_SIZES[0], _SIZES[1]), nn.Tanh(), nn.Linear(_SIZES[1], _SIZES[2]))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step`` (inputs, targets)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(_SAMPLES, _SIZES[0], generator=g), torch.randn(_SAMPLES, _SIZES[2], generator=g)


def _flat(model: nn.Module, world_size: int) -> torch.Tensor:
    """The model's parameters in one padded flat tensor, in the order FlatParamGroup lays them out."""
    values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return torch.cat([values, values.new_zeros(padded_numel(values.numel(), world_size) - values.numel())])


# ----------------------------------------------------------------------------- what every rank does

def _one_answer(rank: int, world_size: int, fn: Any, label: str) -> dict[str, Any]:
    model = _mlp()
    group = FlatParamGroup(list(model.parameters()), world_size, rank, "mlp")  # the parameters view group.full
    flat = group.full
    optimizers: list[tuple[torch.optim.Optimizer, list]] = []

    def make_optimizer(tensors: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(list(tensors), **_ADAMW)
        seen: list[list[Optional[torch.Tensor]]] = []  # the gradients of every step() call

        def record(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            seen.append([None if p.grad is None else p.grad.detach().clone()
                         for g in opt.param_groups for p in g["params"]])
        optimizer.register_step_pre_hook(record)
        optimizers.append((optimizer, seen))
        return optimizer

    try:
        step = fn(flat, make_optimizer)
        if not callable(step):
            raise TypeError(f"zero2_rank must return the step function, got {type(step).__name__}")
    except Exception as error:
        raise case_error(f"{label}setting up", error) from error
    steps = []
    for k in range(_STEPS):
        x, y = _batch(k, rank)
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        grad = group.pack_grads()
        with count_collectives() as counter:
            try:
                step(grad.clone())
            except Exception as error:
                raise case_error(f"{label}step {k + 1}", error) from error
        steps.append({"grad": grad, "params": flat.detach().clone(),
                      "calls": [(c.kind, c.nbytes, c.wire_bytes) for c in counter.calls]})
    return {"steps": steps,
            "optimizer_numel": [sum(p.numel() for g in o.param_groups for p in g["params"]) for o, _ in optimizers],
            "state_numel": sum(t.numel() for o, _ in optimizers for state in o.state.values()
                               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0),
            "seen": [seen for _, seen in optimizers]}


def _zero2_rank(rank: int, world_size: int, answers: Any) -> list[dict[str, Any]]:
    """Worker: every answer in turn (a tuple of them when a test checks several in one launch)."""
    several = isinstance(answers, tuple)
    out = []
    with warnings.catch_warnings():  # torch 2.13 warns at each call of the collectives' older names
        warnings.simplefilter("ignore", FutureWarning)
        for index, shipped in enumerate(answers if several else (answers,)):
            out.append(_one_answer(rank, world_size, shipped.load(), f"answer {index}, " if several else ""))
    return out


# ----------------------------------------------------------------------------- one process, the reference

def _one_process() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the initial flat parameters, the flat parameters after each step) of AdamW on the whole batch."""
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), **_ADAMW)
    initial, after = _flat(model, _WORLD), []
    for k in range(_STEPS):
        batches = [_batch(k, r) for r in range(_WORLD)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()  # equal micro-batches: the mean of the ranks' means
        optimizer.step()
        after.append(_flat(model, _WORLD))
    return initial, after


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=_TOL, rtol=1e-4)


def _diagnose(ranks: list[dict[str, Any]], initial: torch.Tensor,
              reference: list[torch.Tensor]) -> Optional[tuple[str, str, str]]:
    """(case, the named mistake, hint) for one answer's records on every rank, or None when it is right."""
    total = initial.numel()
    shard = total // _WORLD
    for rank, record in enumerate(ranks):
        if not record["optimizer_numel"]:
            return ("setting up", f"rank {rank} never called make_optimizer",
                    "each rank updates its shard with AdamW: build it once, in the set-up, over what this rank updates")
        if sum(record["optimizer_numel"]) > shard:
            return ("setting up", f"rank {rank}'s AdamW updates {sum(record['optimizer_numel'])} elements, the "
                    f"whole buffer is {total}: the full parameters are updated instead of this rank's shard",
                    f"with ZeRO each of the {_WORLD} ranks keeps the optimizer states of its own {shard} elements "
                    "only; "
                    "AdamW is element-wise, so updating a slice gives that slice of the full update")
    grad_bytes = total * 4
    for rank, record in enumerate(ranks):
        calls = record["steps"][0]["calls"]
        if any(kind == "all_reduce" and nbytes >= grad_bytes for kind, nbytes, _ in calls):
            return ("step 1", f"rank {rank} all-reduced the whole gradient: that is data parallelism's (and ZeRO-1's) "
                    "exchange, and every rank then holds all of the reduced gradient",
                    "this rank updates only its shard: which half of the ring all-reduce leaves each rank the sum "
                    "of exactly that part?")
        sent = sum(wire for _, _, wire in calls)  # an all-gather of every rank's gradient shows here too
        budget = 2 * ring_wire_bytes("reduce_scatter", grad_bytes, _WORLD)
        if sent > budget * 1.01:
            return ("step 1", f"rank {rank} sent {sent:,.0f} bytes in one step, a reduce-scatter of the gradient and "
                    f"an all-gather of the parameters send {budget:,.0f}",
                    "each collective moves the buffer once: look for one that moves something twice or whole")
    grads = [record["steps"][0]["grad"] for record in ranks]
    mean = sum(grads) / _WORLD
    for rank, record in enumerate(ranks):
        seen = [calls[0] for calls in record["seen"] if calls]
        if not seen:
            return ("step 1", f"rank {rank} never called optimizer.step()", "AdamW updates the shard in step()")
        got = next((g for g in seen[0] if g is not None), None)
        mine = slice(rank * shard, (rank + 1) * shard)
        if got is None:
            return ("step 1", f"rank {rank}'s shard had no .grad when AdamW stepped",
                    "the optimizer reads the gradient from the .grad of the tensor it updates")
        if got.numel() != shard:
            return ("step 1", f"rank {rank}'s AdamW saw a gradient of {got.numel()} elements, its shard has {shard}",
                    "the shard's gradient is this rank's part of the reduced gradient")
        got = got.reshape(-1)
        if _close(got, mean[mine]):
            continue
        if _close(got, _WORLD * mean[mine]):
            return ("step 1", f"rank {rank}'s AdamW saw {_WORLD} times the mean gradient: the sum over the ranks was "
                    "not divided by the world size",
                    "one process averages the loss over the whole batch; what did the reduce-scatter compute?")
        if _close(got, grads[rank][mine]):
            return ("step 1", f"rank {rank}'s AdamW saw only its own micro-batch's gradient: it was not reduced over "
                    "the ranks", "every rank's micro-batch contributes to the gradient of every element")
        other = next((r for r in range(_WORLD) if r != rank and _close(got, mean[r * shard:(r + 1) * shard])), None)
        if other is not None:
            return ("step 1", f"rank {rank}'s AdamW saw rank {other}'s shard of the mean gradient",
                    "rank r owns elements r·P/N to (r+1)·P/N: its optimizer must see the gradient of those")
        return ("step 1", f"rank {rank}'s AdamW saw a gradient that differs from its shard of the mean gradient by up "
                f"to {float((got - mean[mine]).abs().max()):.3g}", "the mean over the ranks, this rank's part of it")
    for rank, record in enumerate(ranks):
        params = record["steps"][0]["params"]
        if _close(params, reference[0]):
            continue
        if _close(params, initial):
            return ("step 1", f"rank {rank}'s flat_params still holds the old parameters after the step, although "
                    "AdamW updated the shard: the parameters were gathered before the update, or into another tensor",
                    "the model computes with flat_params itself; what must have happened to every shard before "
                    "the ranks exchange them?")
        mine = slice(rank * shard, (rank + 1) * shard)
        if _close(params[mine], reference[0][mine]):
            return ("step 1", f"rank {rank}'s own shard of flat_params is right after the step, the other ranks' "
                    "shards are not", "every rank's model needs every updated shard")
        break
    for k in range(_STEPS):
        for rank, record in enumerate(ranks):
            params = record["steps"][k]["params"]
            if not _close(params, reference[k]):
                return (f"step {k + 1}", f"rank {rank}'s parameters differ from one process's by up to "
                        f"{float((params - reference[k]).abs().max()):.3g}",
                        "each step: the mean gradient's shard, AdamW on the shard, every shard back into flat_params")
    return None


def check_zero2_steps(answers: list[Any]) -> list[CheckResult]:
    """Check several ``zero2_rank`` answers in one launch of ``_WORLD`` gloo ranks (a test's wrong answers).

    Returns:
        One :class:`CheckResult` per answer; all the same failure when the launch itself fails
        (an answer that raises or hangs fails the launch: check it alone).
    """
    name = "zero2_step"
    for fn in answers:
        require_callable(fn, "zero2_rank")
    todo = [k for k, fn in enumerate(answers) if not is_stub(fn)]
    results: list[CheckResult] = [stub_result(name, "zero2_rank")] * len(answers)
    if not todo:
        return results
    records = run_on_ranks(name, [answers[k] for k in todo], _zero2_rank, _WORLD, crash_hint=_crash_hint)
    if isinstance(records, CheckResult):
        return [records if k in todo else results[k] for k in range(len(answers))]
    initial, reference = _one_process()
    shard = initial.numel() // _WORLD
    for position, k in enumerate(todo):
        problem = _diagnose([records[rank][position] for rank in range(_WORLD)], initial, reference)
        results[k] = failed(name, *problem) if problem else passed(
            name, f"{_STEPS} AdamW steps on {_WORLD} gloo ranks equal one process; each rank keeps the states and the "
            f"reduced gradient of {shard} of {initial.numel()} elements")
    return results


def check_zero2_step(fn: Any) -> CheckResult:
    """Check ``zero2_rank`` on 2 gloo ranks: 3 AdamW steps against one process, and what each rank keeps and sends."""
    require_callable(fn, "zero2_rank")
    return check_zero2_steps([fn])[0]


def _crash_hint(message: str) -> str:
    if "NameError" in message:
        return "the ranks run only the source of zero2_rank: import and define everything inside it"
    if "does not support" in message:
        return ("gloo has no list form of this collective: use the one-tensor form (reduce_scatter_tensor, "
                "all_gather_into_tensor)")
    if "size" in message or "shape" in message or "numel" in message:
        return "reduce-scatter takes the whole (P,) buffer and fills a (P/N,) tensor; all-gather the reverse"
    if "leaf" in message:
        return "AdamW updates tensors of their own (or views of a tensor that needs no gradient)"
    return ""
