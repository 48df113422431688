"""What the dp axis does with a stage's gradients and optimizer state: ``Plan.sync`` names it.

:func:`~parallel_lib.training.run.train` builds one per rank, after the tensor-parallel and
pipeline splits ([3] of :mod:`.run`), and calls, every step::

    axis.reduce_gradients()        # after the pipeline's backward: the dp mean (or its shard)
    axis.reduced_gradient(p)       # the reduced gradient of p (the tied embedding's sum over the pipeline's ends)
    axis.clip_grad_norm_(max_norm) # with RunConfig.max_grad_norm: by the global norm of the mean gradient
    axis.step()                    # the optimizer on what this rank owns

at the measured step ``axis.census()`` (bytes of parameters, gradients and optimizer states it
holds; ZeroEngine's is :func:`~parallel_lib.sharding.memory.engine_census`, see
:func:`~parallel_lib.training.zero_options.axis_census`), and once at the end ``axis.remove()``
(the full parameters back in the model, as plain tensors). ``axis.master``
lists the tensors the optimizer updates on this rank (their elements: what the rank owns).
The pipeline runtime runs the module :func:`data_parallel_axis` returns beside it: the stage
itself, or a wrapper whose forward the sync needs (PyTorch's ``DistributedDataParallel``).

``"zero"``: :class:`~parallel_lib.sharding.zero.ZeroEngine` at ``Plan.zero`` (chapter 06; stage
0 is plain data parallelism, one all-reduce per bucket), with the run's precision, collectives,
prefetch and bucket size (:mod:`.zero_options`). ``"ddp"``, ``"zero_redundancy"``, ``"fsdp2"``:
PyTorch's own, for chapter 06's comparisons (:mod:`.torch_sharding`).

``"naive"``, ``"bucketed"``, ``"ring"``, ``"none"`` (and ``"ddp"`` above): chapter 01's gradient
averagers, each replica stepping its own optimizer (:mod:`.averagers`).

With context or expert parallelism (``sync="zero"`` only) the replicas are more than the dp
axis: the ``cp`` ranks of a sequence and the ``ep`` ranks (each with rows of its own) average
their gradients too, so ZeRO runs over the flattened group :func:`replica_axes` names (the
mesh builds it, :func:`mesh_flatten`); under ``ep`` the experts get an engine of their own over
``dp`` (:class:`~parallel_lib.training.experts.ExpertAxis`).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from parallel_lib.runtime.mesh import AxisSpec, RankMesh
from parallel_lib.sharding.zero import ZeroEngine
from parallel_lib.training.averagers import AVERAGERS, averager_axis
from parallel_lib.training.experts import ExpertAxis
from parallel_lib.training.torch_sharding import WHOLE_MODEL, ddp_axis, fsdp2_axis, zero_redundancy_axis

__all__ = ["SYNCS", "WHOLE_MODEL", "data_parallel_axis", "replica_axes", "mesh_flatten"]


def replica_axes(plan: Any) -> AxisSpec:
    """The mesh axes whose ranks average their gradients: ``"dp"``, or ``("dp", "cp")`` / ``("dp", "ep")``."""
    return ("dp", "cp") if plan.cp > 1 else ("dp", "ep") if plan.ep > 1 else "dp"


def mesh_flatten(plan: Any) -> list[tuple[str, ...]]:
    """The flattened groups ``Mesh.build`` must make for ``plan`` (``flatten=``): the replicas' group, if flattened."""
    axes = replica_axes(plan)
    return [axes] if isinstance(axes, tuple) else []


def _zero(plan: Any, run: Any, stage: nn.Module, pm: RankMesh) -> tuple[nn.Module, Any]:
    if plan.ep > 1:
        return stage, ExpertAxis(plan, run, stage, pm)
    return stage, ZeroEngine(stage, plan.zero, lr=run.lr, eps=run.eps, weight_decay=run.weight_decay,
                             precision=run.precision, collectives=run.collectives, bucket_cap_mb=run.bucket_cap_mb,
                             prefetch=run.prefetch, layer_groups=list(stage.h) or None,
                             group=pm.group(replica_axes(plan)), separate=stage.tied)


# Plan.sync -> how the dp axis is built: (plan, run, stage, rank mesh) -> (module to run, the axis above)
SYNCS: dict[str, Callable[[Any, Any, nn.Module, RankMesh], tuple[nn.Module, Any]]] = {
    "zero": _zero, "ddp": ddp_axis, "zero_redundancy": zero_redundancy_axis, "fsdp2": fsdp2_axis}
SYNCS.update({sync: averager_axis for sync in AVERAGERS if sync not in SYNCS})  # "ddp": PyTorch's, above


def data_parallel_axis(plan: Any, run: Any, stage: nn.Module, pm: RankMesh) -> tuple[nn.Module, Any]:
    """The dp axis's gradient reduction and optimizer for this rank's ``stage``, as ``plan.sync`` names.

    Args:
        plan: the :class:`~parallel_lib.training.plan.Plan` (``sync``, ``zero``).
        run: the :class:`~parallel_lib.training.run.RunConfig` (the optimizer's settings).
        stage: this rank's stage (after the tensor-parallel split), on its device.
        pm: the built mesh (``pm.group("dp")``).

    Returns:
        The module the pipeline runtime runs (the stage, or a wrapper of it) and the axis.
    """
    return SYNCS[plan.sync](plan, run, stage, pm)
