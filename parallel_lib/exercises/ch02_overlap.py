"""Chapter 02's overlap exercise: a hook-driven, bucketed all-reduce, checked on real ranks.

The student's ``attach_bucketed_allreduce(model, bucket_bytes)`` registers hooks and returns a
``finish()``. Two gloo ranks run one backward pass with it while ``dist.all_reduce`` is wrapped
to note whether each call came *during* ``loss.backward()`` (overlapped with the backward of
earlier layers), whether it was asynchronous, and how many there were. Then every rank's
gradients must equal their mean over the ranks, computed from an unhooked copy of the model.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, stub_result
from parallel_lib.exercises._ranks import run_on_ranks
from parallel_lib.exercises._shipping import ShippedFunction

__all__ = ["check_bucketed_allreduce", "OVERLAP_STUB"]

OVERLAP_STUB = '''\
def attach_bucketed_allreduce(model, bucket_bytes):
    """Make loss.backward() average the gradients over all ranks while it is still running.

    Register hooks on the parameters so that each bucket of about `bucket_bytes` bytes of
    gradients is all-reduced (dist.all_reduce(..., async_op=True)) as soon as all its gradients
    exist. Return a function finish() that waits for the all-reduces and leaves every .grad
    holding the mean over the ranks.
    """
    ...  # your code here
'''

_WORLD, _TIMEOUT_S, _BUCKET_BYTES = 3, 90.0, 40_000  # 3 ranks: a hard-coded / 2 cannot pass
_LAYERS = 6  # 6 x (64 x 64 + 64) float32 parameters: 99,840 bytes of gradients, 12 tensors


def _overlap_rank(rank: int, world_size: int, shipped: ShippedFunction, bucket_bytes: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(_LAYERS)])
    plain = copy.deepcopy(model)
    torch.manual_seed(100 + rank)
    x = torch.randn(8, 64)
    plain(x).pow(2).mean().backward()
    calls = {"during": 0, "after": 0, "async": 0}
    in_backward = [False]
    real = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls["during" if in_backward[0] else "after"] += 1
        calls["async"] += bool(kwargs.get("async_op") or (len(args) >= 2 and args[1]))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        finish = shipped.load()(model, bucket_bytes)
        loss = model(x).pow(2).mean()
        in_backward[0] = True
        loss.backward()
        in_backward[0] = False
        if callable(finish):
            finish()
    finally:
        dist.all_reduce = real
    return {"own": [p.grad for p in plain.parameters()], "calls": calls, "finish": callable(finish),
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]}


def _judge(results: list[dict]) -> Optional[tuple[str, str]]:
    """(what is wrong, hint) or None."""
    if not results[0]["finish"]:
        return "attach_bucketed_allreduce did not return a function", "return finish, a function that waits"
    mean = [sum(grads) / len(results) for grads in zip(*(r["own"] for r in results))]
    for rank, result in enumerate(results):
        for k, (got, want) in enumerate(zip(result["grads"], mean)):
            if got is None:
                return f"rank {rank}: parameter {k} has no .grad", "keep the gradients: write the mean back into .grad"
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
                if torch.allclose(got, want * len(results), rtol=1e-5, atol=1e-7):
                    return f"rank {rank}: parameter {k} holds the sum over the ranks", "divide by dist.get_world_size()"
                if torch.allclose(got, result["own"][k]):
                    return f"rank {rank}: parameter {k} is unchanged", "copy the reduced bucket back into each .grad"
                return f"rank {rank}: parameter {k} is not the mean over the ranks", "wait for every handle first"
    calls = results[0]["calls"]
    total = calls["during"] + calls["after"]
    if calls["during"] == 0:
        return (f"all {total} all-reduce(s) started after loss.backward() returned: nothing overlapped",
                "launch a bucket from a hook (p.register_post_accumulate_grad_hook) as soon as it is full")
    if calls["async"] < calls["during"]:
        return ("an all-reduce in a hook was blocking: backward stopped until every rank got there",
                "use dist.all_reduce(flat, async_op=True) and wait for the handles in finish()")
    if total >= 2 * _LAYERS:
        return (f"{total} all-reduces for {2 * _LAYERS} gradient tensors: one per tensor, no buckets",
                f"gather gradients into buckets of about bucket_bytes={_BUCKET_BYTES} bytes (torch.cat them)")
    return None


def check_bucketed_allreduce(fn: Any) -> CheckResult:
    """Check ``attach_bucketed_allreduce(model, bucket_bytes)`` on real gloo ranks: correct, bucketed, overlapped."""
    name = "bucketed_allreduce"
    require_callable(fn, "attach_bucketed_allreduce")
    if is_stub(fn):
        return stub_result(name, "attach_bucketed_allreduce")
    results = run_on_ranks(name, fn, _overlap_rank, _WORLD, _BUCKET_BYTES, timeout=_TIMEOUT_S,
                           same_calls="every rank must make the same all-reduces in the same order (the same buckets)")
    if isinstance(results, CheckResult):
        return results
    problem = _judge(results)
    if problem:
        return failed(name, f"{_WORLD} ranks, {_LAYERS} linear layers", *problem)
    calls = results[0]["calls"]
    return passed(name, f"{_WORLD} gloo ranks: the mean gradients, {calls['during']} of "
                  f"{calls['during'] + calls['after']} bucket all-reduce(s) launched during backward")
