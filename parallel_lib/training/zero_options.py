"""Chapter 06's options of a run of the one training entry, and what they need from the dp axis.

:class:`~parallel_lib.training.run.RunConfig` carries them (the same on every rank):

- ``precision``, ``collectives``, ``prefetch``, ``bucket_cap_mb``: how ZeRO's engine shards and
  talks (bf16 parameters and gradients with an fp32 master; torch's or the course's ring
  collectives; ZeRO-3's early all-gather; the gradient buckets of stages 0-2);
- ``freeze``: parameters, by the dense model's names, that do not train (here and in the
  one-process :func:`~parallel_lib.training.reference`);
- ``max_grad_norm``: clip the mean gradient by its global L2 norm before each step (the axis's
  own ``clip_grad_norm_``: ZeRO's gradients are sharded, torch's call would clip nothing);
- ``measure_step``: the step whose census and collectives the result reports;
- ``return_shards``: each rank's checkpoint shard (:func:`~parallel_lib.sharding.shard_state`).

:func:`check_zero_options` refuses, naming the field, what cannot run, before any rank starts.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from parallel_lib.common.checks import check_choice, check_int, check_number, positive_number
from parallel_lib.common.timeline import TimelineRecorder
from parallel_lib.sharding.memory import engine_census
from parallel_lib.sharding.zero import COLLECTIVES, PRECISIONS, ZeroEngine

__all__ = ["check_zero_options", "freeze_parameters", "measured_step", "axis_census", "zero_padding",
           "trace_collectives"]


def check_zero_options(run: Any, plan: Any = None) -> None:
    """Raise ValueError, naming the field, for chapter 06's options that cannot work (with ``plan``: on that plan).

    Raises:
        ValueError: an unknown precision or collectives, a bucket size not above 0, a negative or
            NaN max_grad_norm, a measure_step outside the run's steps, freeze not a tuple of names,
            or (with a plan) clipping or checkpoint shards where they are not supported.
    """
    check_choice("precision", run.precision, PRECISIONS)
    check_choice("collectives", run.collectives, COLLECTIVES)
    positive_number("bucket_cap_mb", run.bucket_cap_mb)
    check_number("max_grad_norm", run.max_grad_norm, 0.0, hint="0 turns clipping off")
    check_int("measure_step", run.measure_step, -run.steps, run.steps - 1,
              hint=f"a step of the run's steps={run.steps} (-1: the last)")
    if isinstance(run.freeze, str) or not all(isinstance(n, str) for n in run.freeze):
        raise ValueError(f"freeze must be a tuple of parameter names, e.g. ('transformer.wpe.weight',), "
                         f"got freeze={run.freeze!r}")
    if plan is None:
        return
    if run.max_grad_norm and (plan.tp > 1 or plan.pp > 1):
        raise ValueError(f"max_grad_norm clips by the norm over the dp axis only: it needs tp=1 and pp=1, got "
                         f"tp={plan.tp}, pp={plan.pp}; set max_grad_norm=0.0")
    if run.max_grad_norm and plan.ep > 1:
        raise ValueError(f"max_grad_norm with ep={plan.ep} is not supported yet (the experts' gradients and the "
                         "rest are reduced over different groups); set max_grad_norm=0.0")
    if run.return_shards and (plan.cp > 1 or plan.ep > 1):
        raise ValueError(f"return_shards with cp={plan.cp} or ep={plan.ep} is not supported yet; set "
                         "return_shards=False")
    if run.return_shards and (plan.sync != "zero" or plan.tp > 1 or plan.pp > 1):
        raise ValueError(f"return_shards saves ZeroEngine's shards of the whole model: it needs sync='zero', tp=1 "
                         f"and pp=1, got sync={plan.sync!r}, tp={plan.tp}, pp={plan.pp}")


def freeze_parameters(model: nn.Module, names: tuple[str, ...], prefix: str = "") -> None:
    """Set ``requires_grad=False`` on the parameters ``names`` (the dense model's names) of ``model``.

    ``prefix`` is what ``model``'s own names lack (``"transformer."`` for a pipeline stage).

    Raises:
        ValueError: a name that is not a parameter of the model.
    """
    params = {prefix + n: p for n, p in model.named_parameters()}
    for name in names:
        if name not in params:
            raise ValueError(f"freeze names an unknown parameter {name!r}; e.g. {list(params)[:3]}")
        params[name].requires_grad_(False)


def measured_step(run: Any) -> int:
    """The index of the step whose census and collectives are reported (``measure_step``, -1: the last)."""
    return run.measure_step % run.steps


def axis_census(axis: Any) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states the dp axis holds now (``{..., "total"}``)."""
    return engine_census(axis) if isinstance(axis, ZeroEngine) else axis.census()


def zero_padding(axis: Any) -> int:
    """Elements ZeRO added to round its flat groups up to a multiple of the dp ranks (0 for other syncs)."""
    return sum(g.padded - g.numel for g in axis.groups) if isinstance(axis, ZeroEngine) else 0


def trace_collectives(axis: Any, recorder: Optional[TimelineRecorder], plan: Any) -> None:
    """Let ZeRO's engine record its collectives (and ZeRO-3's per-group compute) on ``recorder``; None: stop.

    Only for a plan over dp alone: the engine names its lanes "rank R comm" and "rank R compute"
    by its rank in its group, which is the global rank only when dp spans the mesh.
    """
    if isinstance(axis, ZeroEngine):
        axis.recorder = recorder if plan.mesh.world_size == plan.dp else None
