"""Chapter 07's exercise on Megatron's ``f`` and ``g``, written as autograd functions and run on gloo ranks.

The student returns two callables; the checker ships them to ``_WORLD`` gloo ranks and, in
one launch, (1) calls each operator alone on tensors that differ between the ranks, so that
its forward and its backward read as "identity", "sum over ranks", "mean over ranks" or
something else, and (2) splits a dense MLP column→row over the ranks with ``f`` before and
``g`` after, and compares the output, the input gradient and every weight gradient with the
dense MLP run in the notebook's process (chapter 07's proof). Step (1) names the typical
mistakes (f and g swapped, a backward not all-reduced, a forward that averages, ...); step (2)
catches anything else.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, show, stub_result
from parallel_lib.exercises._ranks import case_error, run_on_ranks
from parallel_lib.exercises._shipping import ShippedFunction

__all__ = ["OPERATORS_STUB", "check_tp_operators"]

OPERATORS_STUB = '''\
import torch
import torch.distributed as dist


def tp_operators():
    """Return (f, g), Megatron's two operators of tensor parallelism: each a callable tensor -> tensor
    that autograd differentiates (for example the .apply of a torch.autograd.Function).

    f goes before a column-parallel layer, whose ranks all read the same whole input;
    g goes after the row-parallel layer, where each rank holds a partial output.
    Use torch.distributed on the default group, and define everything inside this
    function: the checker ships its source to 2 gloo ranks.
    """
    ...  # your code here
'''

_WORLD = 2
_HIDDEN, _BATCH = 4, 3
_EXPECTED = {"f": ("identity", "sum"), "g": ("sum", "identity")}  # (forward, backward) of each operator


# ----------------------------------------------------------------------------- what every rank computes

def _probe_input(rank: int) -> torch.Tensor:
    """A tensor that differs between ranks, so identity, sum and mean over ranks all differ."""
    return torch.tensor([1.0, -2.0, 3.0]) * (rank + 1) + rank


def _probe_gradient(rank: int) -> torch.Tensor:
    return torch.tensor([0.5, 4.0, -1.0]) * (rank + 2)


def _dense_mlp() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The dense MLP (h -> 4h -> h), its input and the weights of its loss, the same in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        mlp = nn.Sequential(nn.Linear(_HIDDEN, 4 * _HIDDEN), nn.GELU(), nn.Linear(4 * _HIDDEN, _HIDDEN))
    g = torch.Generator().manual_seed(8)
    return mlp, torch.randn(_BATCH, _HIDDEN, generator=g), torch.randn(_BATCH, _HIDDEN, generator=g)


def _shards(mlp: nn.Sequential, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's column slice of the first layer and row slice of the second (the bias of the second whole)."""
    fc1, fc2 = mlp[0], mlp[2]
    return {"fc1.weight": fc1.weight.detach().chunk(world_size, 0)[rank],
            "fc1.bias": fc1.bias.detach().chunk(world_size)[rank],
            "fc2.weight": fc2.weight.detach().chunk(world_size, 1)[rank], "fc2.bias": fc2.bias.detach()}


def _operators_rank(rank: int, world_size: int, student: ShippedFunction) -> dict[str, Any]:
    """Worker: each operator alone, then the split MLP; returns the tensors the checker compares."""
    try:
        made = student.load()()
        f, g = made
        if not (callable(f) and callable(g)):
            raise TypeError(f"tp_operators() must return two callables (f, g), got {show(made, 80)}")
    except Exception as error:
        raise case_error("tp_operators()", error) from error
    probes = {}
    for name, op in (("f", f), ("g", g)):
        x = _probe_input(rank).requires_grad_()
        try:
            y = op(x)
            y.backward(_probe_gradient(rank))
        except Exception as error:
            raise case_error(f"{name} alone", error) from error
        probes[name] = (y.detach().clone(), None if x.grad is None else x.grad.clone())
    mlp, x, loss_weights = _dense_mlp()
    params = {k: v.clone().requires_grad_() for k, v in _shards(mlp, rank, world_size).items()}
    x = x.clone().requires_grad_()
    try:
        h = F.gelu(F.linear(f(x), params["fc1.weight"], params["fc1.bias"]))   # (batch, 4h/t): my columns
        y = g(F.linear(h, params["fc2.weight"])) + params["fc2.bias"]          # partial products, summed by g
        (y * loss_weights).sum().backward()
    except Exception as error:
        raise case_error("the column→row MLP", error) from error
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in params.items()}
    return {"probes": probes, "output": y.detach().clone(), "x.grad": None if x.grad is None else x.grad.clone(),
            "grads": grads}


# ----------------------------------------------------------------------------- comparing, in the notebook

def _kind(got: Optional[torch.Tensor], mine: torch.Tensor, everyone: list[torch.Tensor]) -> str:
    """What an operator did to this rank's tensor: identity, sum, mean (over the ranks), none or other."""
    if got is None:
        return "none"
    got = torch.as_tensor(got)
    if got.shape != mine.shape:
        return "other"
    total = torch.stack(everyone).sum(0)
    for kind, value in (("identity", mine), ("sum", total), ("mean", total / len(everyone))):
        if torch.allclose(got.double(), value.double(), atol=1e-6):
            return kind
    return "other"


_OPERATOR_HINTS = {
    ("f", "forward", "sum"): ("f's forward all-reduces", "before the column-parallel layer every rank already "
                              "holds the same whole input: summing the copies counts it t times"),
    ("f", "forward", "mean"): ("f's forward averages over the ranks", "the input is already whole and the same on "
                               "every rank: nothing needs to cross between ranks on the way in"),
    ("g", "forward", "identity"): ("g's forward returns the partial output unchanged", "after the row-parallel layer "
                                   "each rank holds only its part of X·A (section 1): the dense output needs all of "
                                   "them"),
    ("g", "forward", "mean"): ("g's forward averages the partial outputs", "the dense output is X1·A1 + X2·A2, "
                               "not their mean"),
    ("f", "backward", "identity"): ("f's backward is not all-reduced: the input gradient is only this rank's share",
                                    "the input feeds every rank's slice of the first layer, and each slice sends "
                                    "back its own part of dL/dx; the dense gradient is made of all of them"),
    ("f", "backward", "mean"): ("f's backward averages over the ranks", "each rank's part of dL/dx is a term of the "
                                "dense gradient, not an estimate of it"),
    ("g", "backward", "sum"): ("g's backward all-reduces: the gradient reaching each rank is t times too large",
                               "the output is a sum of the ranks' partial results: how does the gradient of a sum "
                               "reach each of its terms?"),
    ("g", "backward", "mean"): ("g's backward averages over the ranks", "each rank already holds the whole "
                                "gradient of the output; nothing needs to cross between ranks on the way back"),
}


def _operator_problem(results: list[dict]) -> Optional[tuple[str, str, str]]:
    """(case, named mistake, hint) from the operators run alone, or None when both behave as Megatron's."""
    xs = [_probe_input(r) for r in range(_WORLD)]
    seeds = [_probe_gradient(r) for r in range(_WORLD)]
    for rank, result in enumerate(results):
        kinds = {name: (_kind(result["probes"][name][0], xs[rank], xs),
                        _kind(result["probes"][name][1], seeds[rank], seeds)) for name in ("f", "g")}
        if kinds == {"f": _EXPECTED["g"], "g": _EXPECTED["f"]}:
            return ("f and g alone", "f and g are swapped: f sums in the forward pass and g in the backward pass",
                    "f's input is the same on every rank, g's input is a different partial result on each rank: "
                    "which of the two needs summing on the way forward?")
        for name in ("f", "g"):
            for phase, got, want in zip(("forward", "backward"), kinds[name], _EXPECTED[name]):
                if got == want:
                    continue
                if (name, phase, got) in _OPERATOR_HINTS:
                    what, hint = _OPERATOR_HINTS[(name, phase, got)]
                elif got == "none":
                    what, hint = (f"{name}'s backward gave the input no gradient (None)",
                                  "backward returns the gradient of forward's input")
                else:
                    what, hint = (f"{name}'s {phase} returned neither its input, nor the sum nor the mean over the "
                                  "ranks", "each operator either leaves a tensor as it is or all-reduces it")
                return f"{name} alone", f"rank {rank}: {what}", hint
    return None


def _mlp_problem(results: list[dict]) -> Optional[tuple[str, str]]:
    """(what differs, hint) between a rank's split MLP and the dense one, or None."""
    mlp, x, loss_weights = _dense_mlp()
    x = x.clone().requires_grad_()
    out = mlp(x)
    (out * loss_weights).sum().backward()
    dense_grads = {k: v.grad for k, v in (("fc1.weight", mlp[0].weight), ("fc1.bias", mlp[0].bias),
                                          ("fc2.weight", mlp[2].weight), ("fc2.bias", mlp[2].bias))}
    for rank, result in enumerate(results):
        expected = {"output": out.detach(), "x.grad": x.grad}
        for k, v in dense_grads.items():  # this rank's slice of each dense gradient
            dim = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}.get(k)
            expected[k] = v if dim is None else v.chunk(_WORLD, dim)[rank]
        got = {"output": result["output"], "x.grad": result["x.grad"], **result["grads"]}
        for name, want in expected.items():
            have = got[name]
            if have is None:
                return f"rank {rank}: {name} is None", "every parameter and the input must get a gradient"
            if have.shape != want.shape or not torch.allclose(have, want, atol=1e-5):
                return (f"rank {rank}: {name} differs from the dense MLP's by up to "
                        f"{float((have - want).abs().max()) if have.shape == want.shape else float('nan'):.3g}",
                        "f before the column layer, g after the row layer: check each one's forward and backward")
    return None


def check_tp_operators(fn: Any) -> CheckResult:
    """Check ``tp_operators()`` on 2 gloo ranks: each operator alone, then a column→row MLP against the dense one."""
    name = "tp_operators"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    results = run_on_ranks(name, fn, _operators_rank, _WORLD, crash_hint=_crash_hint)
    if isinstance(results, CheckResult):
        return results
    problem = _operator_problem(results)
    if problem:
        return failed(name, *problem)
    mlp = _mlp_problem(results)
    if mlp:
        return failed(name, "the column→row MLP", *mlp)
    return passed(name, f"f and g alone, and a column→row MLP on {_WORLD} gloo ranks (output, input gradient and "
                  "4 weight gradients equal the dense MLP's)")


def _crash_hint(message: str) -> str:
    if "does not require grad" in message or "grad_fn" in message:
        return "autograd must see the operator: return the .apply of a torch.autograd.Function"
    if "NameError" in message:
        return "the ranks run only the source of tp_operators: import and define everything inside it"
    if "must return two callables" in message or "cannot unpack" in message or "not iterable" in message:
        return "return f, g"
    return ""
