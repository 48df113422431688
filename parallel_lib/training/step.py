"""One pipeline step of a tensor-parallel stage, and putting only that stage on the rank's device.

:func:`~parallel_lib.training.run.train` calls both: :func:`stage_on_device` once, after the
tensor-parallel split ([2] of :mod:`.run`), and :func:`pipeline_step` once per step ([5]).

- :func:`stage_on_device` cuts stage ``j`` out of the rank's TP shard on the CPU and moves only
  that stage to the device; the shard's other stages are freed (issue #20, GPU item 4: a pipeline
  rank used to move and keep the whole shard, so the census said less than the device held).
- :func:`pipeline_step` runs stage ``j``'s actions of a schedule (GPipe, 1F1B, ..., chapter 04's
  ``make_schedule``) for one replica batch with the one pipeline runtime
  (:func:`~parallel_lib.pipeline_parallel.runtime.run_actions`): one ``batch_isend_irecv`` per
  exchange with the same tensor slice of the neighbouring stages; inside each forward and
  backward the stage's tensor-parallel group all-reduces as chapter 07 does.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from parallel_lib.pipeline_parallel.link import StageLink
from parallel_lib.pipeline_parallel.runtime import RankStages, run_actions
from parallel_lib.pipeline_parallel.schedule import Action, Schedule
from parallel_lib.pipeline_parallel.stage import StageRunner, move_stage
from parallel_lib.pipeline_parallel.transports import ProcessLink
from parallel_lib.training.tp_stage import TensorParallelStage, stage_loss

__all__ = ["pipeline_step", "stage_on_device"]

Record = Callable[[str, int], ContextManager[Any]]  # (event kind, micro-batch) -> a timing context


def pipeline_step(stage: TensorParallelStage, runner: StageRunner, link: StageLink, pipeline: list[int],
                  schedule: Schedule, j: int, batch: dict[str, torch.Tensor], denominator: float,
                  recompute: bool, forwards_before: int = 0, record: Optional[Record] = None
                  ) -> tuple[float, int, int]:
    """Stage j's actions of ``schedule`` for one replica batch; the gradients accumulate in the stage.

    Dropout: the model's masks depend on its forward-call number
    (:class:`~parallel_lib.models.dropout.DropoutStream`). Micro-batch ``i`` is forward call
    ``forwards_before + i + 1`` on every stage, in its forward and in its recomputation alike, as
    one process that ran one forward per micro-batch would number it (one micro-batch per step:
    the step's number, as :func:`~parallel_lib.training.reference` counts).

    Args:
        stage, runner: this rank's stage and the runner that keeps its activations.
        link: the process link to the neighbouring stages (``pm.group("pp")``).
        pipeline: the global ranks of this rank's pipeline, in stage order.
        schedule: the schedule; ``j``: this rank's stage.
        batch: the replica's rows (``input_ids``, ``labels``, ``label_token_weights``), cut into
            the schedule's micro-batches here.
        denominator: what each micro-batch's weighted loss sum is divided by.
        recompute: keep only each stage's input, run its forward again in backward.
        forwards_before: the micro-batch forwards of the steps before this one.
        record: ``record(kind, micro_batch)`` gives a context that times one action's compute
            (a :class:`~parallel_lib.common.timeline.TimelineRecorder`'s ``record`` for this rank's
            lane); None: untimed.

    Returns:
        The sum of the micro-batches' losses on the last stage (0.0 elsewhere), the most bytes
        autograd held saved for backward at once on this rank during the step (one micro-batch's
        forward when there is one micro-batch), and the most micro-batches whose activations it
        held at once (GPipe: all of them; 1F1B: at most the stages from this one to the last).
    """
    m = schedule.num_micro_batches
    ids, labels, weights = (torch.tensor_split(batch[k], m) for k in ("input_ids", "labels", "label_token_weights"))
    dtype = next(stage.parameters()).dtype  # the hidden states every stage sends: the model's dtype
    spec = lambda message: (stage.hidden_shape(*ids[message.micro_batch].shape), dtype)  # noqa: E731  (1/tp under SP)
    loss = (lambda i: stage_loss(stage, labels[i], weights[i], denominator)) if stage.last else None
    stream = stage.model.dropout_stream

    def numbered(action: Action, compute: Callable[[], Any]) -> Any:  # the micro-batch's dropout masks
        stream.calls = forwards_before + action.micro_batch + 1
        with record(action.event_kind, action.micro_batch) if record else nullcontext():
            return compute()

    stages = RankStages(schedule, j, {j: runner}, ids, loss=loss, recompute=lambda i: recompute, timed=numbered)
    run_actions(schedule, j, stages, ProcessLink(schedule, j, link, pipeline, spec))
    return stages.loss_sum(), stages.peak_bytes, stages.peak


def stage_on_device(shard: nn.Module, j: int, pp: int, device: torch.device, keep_shard: bool) -> TensorParallelStage:
    """Stage j of this rank's TP shard, alone on ``device``: the shard is cut on the CPU and only the stage moves.

    The stage refers to the whole shard (for its config, group and mask); the other stages' blocks
    are freed (moved to the meta device) unless ``keep_shard`` (``return_state`` gathers the whole shard).
    """
    stage = move_stage(TensorParallelStage(shard, j, pp), device)
    if not keep_shard:
        mine = {id(p) for p in stage.parameters()}
        for module in shard.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in mine:
                    setattr(module, name, nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False))
    return stage
