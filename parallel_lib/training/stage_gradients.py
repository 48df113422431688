"""A stage's gradients after the pipeline's backward: step [6] of :mod:`.run` (chapter 05 shows it).

When a rank has run its stage's backward for every micro-batch, each of its gradients is this
replica's part of the step's gradient. Three sums remain, each over one mesh axis, each a sum
or a mean of the same numbers (their order does not change the result):

- **dp**: the same stage in every replica averages its gradients, over ``pm.group("dp")`` only
  (the dp axis of ``Plan.sync``; ZeRO-0 is one all-reduce per bucket). Stage 0's ranks never
  exchange a byte with stage 1's. (ZeRO-2 and 3 launch their reduce-scatters from backward
  hooks already; here they finish.)
- **tp**: with sequence parallelism, the norms' gradients, summed over the tensor-parallel group
  (chapter 07); nothing otherwise.
- **tied**: GPT-2 ties its LM head to the token embedding. In a pipeline the first stage holds
  the embedding and the last a copy as the head, each with part of the gradient: the two ranks
  add their (dp-reduced) parts with one all-reduce over ``pm.group("tied")``.

Every wait has the run's timeout, and a failure names the rank.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch.distributed as dist

from parallel_lib.pipeline_parallel.link import wait_for
from parallel_lib.runtime.mesh import RankMesh
from parallel_lib.tensor_parallel.sequence import sync_sequence_parallel_grads

__all__ = ["reduce_stage_gradients"]

Comm = Callable[[str], ContextManager[Any]]  # (the axis's label) -> a context that times one communication event


def reduce_stage_gradients(axis: Any, stage: Any, pm: RankMesh, who: str, timeout: float,
                           comm: Optional[Comm] = None) -> None:
    """The dp mean, the sequence-parallel norms' tp sum and the tied sum of one stage's gradients.

    Args:
        axis: the dp axis (:func:`~parallel_lib.training.data_axis.data_parallel_axis`):
            ``reduce_gradients()`` and ``reduced_gradient(p)``.
        stage: this rank's :class:`~parallel_lib.training.tp_stage.TensorParallelStage`
            (``stage.tied``: its copies of the tied embedding).
        pm: the built mesh.
        who: how errors name this rank.
        timeout: seconds the tied sum may wait.
        comm: ``comm("dp")`` / ``comm("tied")`` times the communication on the timeline; None: untimed.

    Raises:
        RuntimeError: the dp reduction failed or timed out (the message names the rank).
        TimeoutError: the tied sum waited longer than ``timeout``.
    """
    timed = comm or (lambda label: nullcontext())
    with timed("dp") if pm.size("dp") > 1 else nullcontext():
        try:
            axis.reduce_gradients()
        except RuntimeError as error:
            raise RuntimeError(f"{who}: the gradients' mean over the stage's dp group: {error}") from error
    sync_sequence_parallel_grads(stage.model)
    for p in stage.tied:  # the embedding's two copies: one sum over the pipeline's ends
        with timed("tied"):
            wait_for(dist.all_reduce(axis.reduced_gradient(p), group=pm.group("tied"), async_op=True), timeout,
                     f"{who}: tied embedding's gradient")
