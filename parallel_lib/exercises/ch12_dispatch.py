"""Chapter 12's exercises on the expert-parallel forward: the dispatch's split sizes and rows, and the combine.

Each checker first runs the student's function in this process on routing made by the library's
router and capacity, and compares it with the library: the dispatch with
:func:`~parallel_lib.expert_parallel.dispatch_plan.dispatch_plan` (any order within one expert is
right, since the combine reads the same order back), the combine with the one-process
:class:`~parallel_lib.expert_parallel.moe.MoE` (its output, and the gradients of the router, the
experts and the input). A wrong answer is named there, without starting ranks; the typical ones
are computed and matched. An answer that agrees is then run where it belongs: shipped to 2 gloo
ranks, it replaces the library's dispatch or combine inside a real expert-parallel forward and
backward (counts exchanged, uneven all-to-all, experts, reverse all-to-all), whose output and
gradients must equal the library's layer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, show, stub_result
from parallel_lib.exercises._ranks import case_error, run_on_ranks
from parallel_lib.exercises._shipping import ShippedFunction
from parallel_lib.expert_parallel.capacity import expert_capacity, keep_within_capacity
from parallel_lib.expert_parallel.dispatch_plan import dispatch_plan
from parallel_lib.expert_parallel.expert_compute import run_experts
from parallel_lib.expert_parallel.expert_parallel_moe import ExpertParallelMoE
from parallel_lib.expert_parallel.moe import MoE, MoEConfig, route_tokens
from parallel_lib.expert_parallel.router import top_k_route
from parallel_lib.expert_parallel.uneven_all_to_all import all_to_all, exchange_counts

__all__ = ["DISPATCH_STUB", "COMBINE_STUB", "check_dispatch_rows", "check_combine_rows"]

DISPATCH_STUB = '''\
import torch


def dispatch_rows(experts, kept, n_experts, ep):
    """Which rows this rank sends in the dispatch all-to-all, from its router's output.

    experts: (T, k) int64, the experts each of this rank's T tokens chose; kept: (T, k) bool, False where
    capacity dropped the choice. Expert e lives on rank e // (n_experts // ep).
    Return (send, token, slot): send, a list of ep ints, the rows for each rank (all_to_all_single's split
    sizes); token and slot, (N,) int64 tensors: row i of the send buffer is token token[i]'s choice slot[i],
    the rows sorted by expert (so each rank's rows, and within them each expert's, are contiguous).
    """
    ...  # your code here
'''

COMBINE_STUB = '''\
import torch


def combine_rows(back, token, slot, weights, n_tokens):
    """The layer's output from the rows the reverse all-to-all brought back.

    back: (N, h), row i is an expert's output for token token[i]'s choice slot[i] (the dispatch's order);
    weights: (T, k), the router's weight of each token's choices (the router's gradient flows through them).
    Return y (n_tokens, h): y[t] = the sum over t's rows i of weights[t, slot[i]] * back[i]; 0 for a token
    whose choices were all dropped.
    """
    ...  # your code here
'''

_HIDDEN, _INNER, _WORLD = 16, 32, 2
# (label, n_experts, top_k, capacity_factor, ep, tokens): easy first; the last sends one rank nothing
_CASES = (("4 experts, top-1, 2 ranks, nothing dropped", 4, 1, None, 2, 8),
          ("4 experts, top-2, 2 ranks, capacity 1.0 (drops)", 4, 2, 1.0, 2, 12),
          ("8 experts, top-2, 4 ranks, capacity 0.5 (many drops)", 8, 2, 0.5, 4, 16),
          ("4 experts, top-1, 2 ranks, every token to expert 0", 4, 1, None, 2, 6))
_RANK_CASES = (dict(n_experts=4, top_k=2, capacity_factor=1.0), dict(n_experts=4, top_k=1))


def _routing(index: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Case ``index``'s (experts, kept, n_experts, ep), from the library's router and capacity."""
    label, n_experts, top_k, factor, ep, tokens = _CASES[index]
    logits = torch.randn(tokens, n_experts, generator=torch.Generator().manual_seed(60 + index))
    if "expert 0" in label:
        logits[:, 0] += 10.0
    experts = top_k_route(logits, top_k).experts
    kept = keep_within_capacity(experts, n_experts, expert_capacity(tokens, n_experts, top_k, factor))
    return experts, kept, n_experts, ep


def _as_plan(got: Any) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise TypeError("(send, token, slot): a tuple of three")
    send, token, slot = got
    send = [int(n) for n in (send.tolist() if isinstance(send, torch.Tensor) else send)]
    token, slot = torch.as_tensor(token).reshape(-1).long(), torch.as_tensor(slot).reshape(-1).long()
    if token.shape != slot.shape:
        raise ValueError(f"token and slot of the same length, got {len(token)} and {len(slot)}")
    return send, token, slot


def _dispatch_problem(experts: torch.Tensor, kept: torch.Tensor, n_experts: int, ep: int,
                      got: tuple[list[int], torch.Tensor, torch.Tensor]) -> Optional[tuple[str, str]]:
    """None when ``got`` is a right dispatch; else (what is wrong, hint)."""
    send, token, slot = got
    ref = dispatch_plan(experts, kept, n_experts, ep)
    tokens, k = experts.shape
    if len(token) and (int(token.min()) < 0 or int(token.max()) >= tokens or int(slot.min()) < 0
                       or int(slot.max()) >= k):
        return (f"token or slot out of range (tokens 0..{tokens - 1}, slots 0..{k - 1})",
                "row i is token token[i]'s choice slot[i]: torch.nonzero(kept, as_tuple=True) gives both")
    if len(send) == n_experts != ep and send == ref.counts.tolist():
        return (f"send = {send} has one size per expert, not one per rank ({ep})",
                "all_to_all_single takes one split size per rank of the group: add up the counts of each "
                "rank's n_experts // ep experts")
    pairs = sorted(zip(token.tolist(), slot.tolist()))
    if pairs != sorted(zip(ref.token.tolist(), ref.slot.tolist())):
        every = sorted((t, j) for t in range(tokens) for j in range(k))
        if pairs == every and not bool(kept.all()):
            return (f"the {int((~kept).sum())} choices capacity dropped were sent too",
                    "a dropped choice (kept False) is not computed: send only the kept choices")
        return (f"the rows sent are not this rank's kept choices: expected {len(ref.token)} rows "
                f"{show(list(zip(ref.token.tolist(), ref.slot.tolist())), 120)}, got {len(pairs)}",
                "one row per kept choice (token, slot)")
    owner_rr = torch.bincount(experts[ref.token, ref.slot] % ep, minlength=ep).tolist()
    if send != ref.send and send == owner_rr and owner_rr != ref.send:
        return (f"send = {send} puts expert e on rank e % ep",
                "the experts are split into contiguous blocks: rank q holds experts q·E/ep .. (q+1)·E/ep - 1")
    if send != ref.send:
        return f"send: expected {ref.send}, got {send}", "rows for rank q: the kept choices of rank q's experts"
    order = experts[token, slot]
    if bool((order[1:] < order[:-1]).any()):
        return (f"the rows are not sorted by expert: their experts are {order.tolist()}",
                "the receiving rank reads its rows as contiguous blocks per expert, in expert order: sort the "
                "rows by expert (a stable argsort)")
    return None


def check_dispatch_rows(fn: Any) -> CheckResult:
    """Check ``dispatch_rows`` against the library's dispatch, then inside a real forward on 2 gloo ranks."""
    name = "dispatch_rows"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    for index, (label, *_rest) in enumerate(_CASES):
        experts, kept, n_experts, ep = _routing(index)
        try:
            got = _as_plan(fn(experts.clone(), kept.clone(), n_experts, ep))
        except (TypeError, ValueError) as error:
            return failed(name, repr(label), f"the answer must be {error}")
        except Exception as error:  # the student's bug, with its case
            return failed(name, repr(label), f"raised {type(error).__name__}: {error}")
        problem = _dispatch_problem(experts, kept, n_experts, ep, got)
        if problem:
            return failed(name, repr(label), *problem)
    return _on_ranks(name, fn, "dispatch", f"{len(_CASES)} cases, then a forward and backward on {_WORLD} gloo ranks")


# ----------------------------------------------------------------------------- the combine

def _combine_reference(back: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor,
                       n_tokens: int) -> torch.Tensor:
    """The library layer's step [7]."""
    return back.new_zeros(n_tokens, back.shape[1]).index_add(0, token, weights[token, slot, None].to(back.dtype) * back)


def _combine_case(index: int, combine: Callable) -> dict[str, Any]:
    """One process: the MoE of case ``index`` with its combine replaced by ``combine``; output and gradients."""
    label, n_experts, top_k, factor, _ep, tokens = _CASES[index]
    moe = MoE(_HIDDEN, _INNER, MoEConfig(n_experts=n_experts, top_k=top_k, capacity_factor=factor), seed=index)
    g = torch.Generator().manual_seed(80 + index)
    x, u = torch.randn(tokens, _HIDDEN, generator=g), torch.randn(tokens, _HIDDEN, generator=g)
    if "expert 0" in label:
        with torch.no_grad():
            moe.router.gate.weight[0] = 1.0
        x = x.abs() + 0.1
    x.requires_grad_(True)
    record = route_tokens(moe.router, x, moe.config)
    plan = dispatch_plan(record.experts, record.kept, n_experts, 1)
    back = run_experts(moe.experts, x[plan.token], plan.expert)
    y = combine(back, plan.token.clone(), plan.slot.clone(), record.weights, tokens)
    out = dict(y=y, plan=plan, record=record, back=back.detach())
    if isinstance(y, torch.Tensor) and y.shape == (tokens, _HIDDEN) and y.requires_grad:
        (y * u).sum().backward()
    out.update(router=moe.router.gate.weight.grad, x=x.grad,
               experts=[p.grad for p in moe.experts.parameters()])
    return out


def _grads_differ(got: dict, expected: dict) -> Optional[str]:
    for part in ("router", "x"):
        if got[part] is None or max_abs_difference(got[part], expected[part]) > 1e-5:
            return part
    for a, b in zip(got["experts"], expected["experts"]):
        if (a is None) != (b is None) or (a is not None and max_abs_difference(a, b) > 1e-5):
            return "experts"
    return None


def check_combine_rows(fn: Any) -> CheckResult:
    """Check ``combine_rows`` against the one-process MoE (output and gradients), then on 2 gloo ranks."""
    name = "combine_rows"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    for index, (label, *_rest) in enumerate(_CASES):
        expected = _combine_case(index, _combine_reference)
        try:
            got = _combine_case(index, fn)
        except Exception as error:  # the student's bug, with its case
            return failed(name, repr(label), f"raised {type(error).__name__}: {error}")
        y = got["y"]
        if y is None:
            return failed(name, repr(label), "returned None: return y")
        if not isinstance(y, torch.Tensor) or y.shape != expected["y"].shape:
            return failed(name, repr(label), f"returned {type(y).__name__} of shape "
                          f"{tuple(getattr(y, 'shape', ()))}, expected {tuple(expected['y'].shape)}",
                          "one row per token of this rank: n_tokens rows of the hidden width")
        if max_abs_difference(y.detach(), expected["y"].detach()) > 1e-5:
            return failed(name, repr(label), *_combine_mistake(got, expected["y"].detach(), y.detach()))
        part = _grads_differ(got, expected)
        if part == "router":
            return failed(name, repr(label), "the output is right but the router's gradient is not",
                          "the weights must stay in the graph (no .detach(), no .item(), no torch.no_grad): the "
                          "balancing of the experts is learnt through them")
        if part:
            return failed(name, repr(label), f"the output is right but the gradient of the {part} is not",
                          "compute y with differentiable operations (index_add, not writes into a tensor made "
                          "under no_grad)")
    return _on_ranks(name, fn, "combine", f"{len(_CASES)} cases, then a forward and backward on {_WORLD} gloo ranks")


def _combine_mistake(got: dict, expected: torch.Tensor, y: torch.Tensor) -> tuple[str, str]:
    plan, record, back = got["plan"], got["record"], got["back"]
    n = expected.shape[0]
    weights = record.weights.detach()
    candidates = [
        (back.new_zeros(n, back.shape[1]).index_add(0, plan.token, back),
         "the rows were summed without the router's weights", "each row is weighted by its choice's weight"),
        (_combine_reference(back, plan.token, torch.zeros_like(plan.slot), weights, n),
         "every row got its token's first weight", "row i's weight is weights[token[i], slot[i]]: slot says which"),
    ]
    overwritten = back.new_zeros(n, back.shape[1])
    overwritten[plan.token] = weights[plan.token, plan.slot, None] * back
    candidates.append((overwritten, "rows of the same token overwrote each other (y[token] = ...)",
                       "a token with two kept choices has two rows: accumulate them (index_add)"))
    for value, what, hint in candidates:
        if torch.allclose(y, value, atol=1e-5):
            return what, hint
    worst = int((y - expected).abs().amax(1).argmax())
    return (f"token {worst}'s output differs by up to {float((y - expected).abs().max()):.3g}",
            "y[t] = Σ weights[t, slot] · row, over the kept choices of t")


# ----------------------------------------------------------------------------- on ranks

def _forward(layer: ExpertParallelMoE, x: torch.Tensor, dispatch: Callable, combine: Callable) -> torch.Tensor:
    """The layer's forward ([1]-[7] of ``expert_parallel_moe``) with its dispatch plan and combine given."""
    record = layer.last = route_tokens(layer.router, x, layer.config)
    send, token, slot = _as_plan(dispatch(record.experts.clone(), record.kept.clone(), layer.config.n_experts,
                                          layer.ep))
    ok = torch.tensor([int(len(send) == layer.ep and sum(send) == len(token))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=layer.group)  # every rank enters the all-to-alls, or none
    if not int(ok):
        raise ValueError(f"send={send} is not one size per rank summing to the {len(token)} rows")
    counts = torch.bincount(record.experts[token, slot], minlength=layer.config.n_experts)
    incoming = exchange_counts(counts, layer.group)
    receive = incoming.sum(1).tolist()
    rows = all_to_all(x[token], send, receive, layer.group)
    expert_of_row = torch.arange(layer.local).repeat(layer.ep).repeat_interleave(incoming.reshape(-1))
    back = all_to_all(run_experts(layer.experts, rows, expert_of_row), receive, send, layer.group)
    return combine(back, token, slot, record.weights, x.shape[0])


def _ep_rank(rank: int, world_size: int, student: ShippedFunction, which: str) -> list[dict[str, float]]:
    """Worker: each rank case, the library's layer against the same layer with the student's dispatch or combine."""
    from parallel_lib.runtime.mesh import Mesh

    fn = student.load()
    dispatch = fn if which == "dispatch" else (lambda e, k, n, ep: (dispatch_plan(e, k, n, ep).send,
                                                                   *_plan_rows(e, k, n, ep)))
    combine = fn if which == "combine" else _combine_reference
    results = []
    with Mesh(ep=world_size).build(timeout=30.0) as pm:
        for index, fields in enumerate(_RANK_CASES):
            label = f"{world_size} ranks, {fields}"
            layers = [ExpertParallelMoE(MoE(_HIDDEN, _INNER, MoEConfig(**fields), seed=index), pm.group("ep"))
                      for _ in range(2)]
            g = torch.Generator().manual_seed(100 * index + rank)
            x, u = torch.randn(12, _HIDDEN, generator=g), torch.randn(12, _HIDDEN, generator=g)
            inputs = [x.clone().requires_grad_(True) for _ in range(2)]
            expected = layers[0](inputs[0])
            (expected * u).sum().backward()
            try:
                y = _forward(layers[1], inputs[1], dispatch, combine)
                (y * u).sum().backward()
            except Exception as error:
                raise case_error(label, error) from error
            grads = [max_abs_difference(a.grad, b.grad) for a, b in zip(layers[0].parameters(), layers[1].parameters())
                     if a.grad is not None]
            results.append(dict(label=label, output=max_abs_difference(y.detach(), expected.detach()),
                                grads=max(grads + [max_abs_difference(inputs[1].grad, inputs[0].grad)])))
    return results


def _plan_rows(experts: torch.Tensor, kept: torch.Tensor, n_experts: int, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    plan = dispatch_plan(experts, kept, n_experts, ep)
    return plan.token, plan.slot


def _on_ranks(name: str, fn: Callable, which: str, what: str) -> CheckResult:
    results = run_on_ranks(name, fn, _ep_rank, _WORLD, which)
    if isinstance(results, CheckResult):
        return results
    for rank, cases in enumerate(results):
        for case in cases:
            if case["output"] > 1e-5 or case["grads"] > 1e-5:
                return failed(name, repr(case["label"]), f"on rank {rank} the layer's output differs from the "
                              f"library's by {case['output']:.3g} and its gradients by {case['grads']:.3g}")
    return passed(name, what)
