"""The one single-process reference: the dense model on the whole global batch, no parallelism.

Independent of every parallel code path: Part I's plain training loop
(:func:`parallel_lib.common.training.train`: Hugging Face's ``GPT2LMHeadModel`` forward with its
causal attention and tied head, the course's weighted loss ``sum(ce · w) / sum(w)``, one optimizer
step per batch) with the run's optimizer (``torch.optim.AdamW``, or SGD). Every layout of
:func:`~parallel_lib.training.run.train` must reach the parameters this reaches.

With dropout, Hugging Face's masks come from torch's global random stream, which no parallel
run can reproduce; the reference then runs the one GPT-2 (:mod:`parallel_lib.models`, equal to
Hugging Face's without dropout, tests/test_gpt2_model.py) with the run's seed, whose seeded
masks (:mod:`parallel_lib.models.dropout`) are numbered by replica and forward call, as the
parallel run numbers them: each of the ``dp`` replicas' rows runs with its replica's masks, cut
into ``micro_batches`` forwards (micro-batch ``i`` of step ``k`` is call ``k · micro_batches + i + 1``,
as :func:`~parallel_lib.training.step.pipeline_step` numbers it), and the step's logits are those
forwards' in row order (:class:`_ReplicaForwards`). With one replica and one micro-batch that is
one forward of the whole batch per step.

With ``run.experts`` the model is chapter 12's mixture of experts (:mod:`.experts`), its tokens
routed in one group per replica and micro-batch (``dp · micro_batches`` groups of rows, each
what one rank routes in one forward; pass ``dp`` = the layout's ``Plan.row_replicas``, dp · ep),
and an expert that no token reached in a step steps on a zero gradient (AdamW's weight decay and
moments move it), as it does in every layout: ZeRO's flat buffers hold a gradient for every parameter.

Chapter 06's options hold here too: ``run.freeze`` leaves those parameters out of AdamW,
``run.max_grad_norm`` clips with torch's ``clip_grad_norm_`` (between backward and step, where Part I's
loop calls its ``average_gradients_fn``), and a plain checkpoint
(:mod:`.checkpoints`) is saved (:func:`reference_checkpoint`) and continued (``resume=``) here;
:func:`plain_checkpoint` turns ZeRO's shards into one.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.common.training import train
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import from_hf
from parallel_lib.sharding.checkpoint import consolidate
from parallel_lib.training.averagers import make_optimizer
from parallel_lib.training.batches import global_batches
from parallel_lib.training.checkpoints import Checkpoint, to_dense
from parallel_lib.training.experts import mixture_of_experts
from parallel_lib.training.run import ModelBuilder, RunConfig, build_model
from parallel_lib.training.zero_options import freeze_parameters

__all__ = ["reference", "reference_checkpoint", "plain_checkpoint"]


def reference(run: RunConfig = RunConfig(), builder: ModelBuilder = build_model, dp: int = 1,
              micro_batches: int = 1, resume: Optional[Checkpoint] = None
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of every step and the final parameters (state-dict names) of one process.

    Args:
        run: the run (model, batches, optimizer) every layout trains.
        builder: builds the dense model from ``run``.
        dp: the replicas of the layout it stands for, each with rows of its own (``Plan.row_replicas``:
            the corpus source orders each global batch's rows by replica,
            :func:`~parallel_lib.training.batches.global_batches`; with dropout each replica draws
            its own masks; with experts each replica's micro-batch is routed as one group).
        micro_batches: the micro-batches each replica's rows are cut into (only dropout's masks,
            numbered by forward, and the experts' routing groups depend on it).
        resume: a plain checkpoint to continue from (the losses are those of the steps run).

    Raises:
        ValueError: see :meth:`RunConfig.check`; ``dp`` or ``micro_batches`` below 1.
    """
    losses, model, _ = _one_process(run, builder, dp, micro_batches, resume)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_checkpoint(run: RunConfig, steps: int, builder: ModelBuilder = build_model) -> Checkpoint:
    """The plain checkpoint one process saves after its first ``steps`` of the run's steps.

    Returns:
        ``(model state, AdamW state, steps)``: what ``train(..., resume=)`` and
        :func:`reference` (``resume=``) continue from at step ``steps``.

    Raises:
        ValueError: ``steps`` not in [1, run.steps].
    """
    check_int("steps", steps, 1, run.steps)
    _, model, optimizer = _one_process(run, builder, 1, 1, None, stop=steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, optimizer.state_dict(), steps


def plain_checkpoint(shards: Sequence[dict[str, Any]], run: RunConfig, first: int,
                     builder: ModelBuilder = build_model) -> Checkpoint:
    """Every rank's ZeRO shard (``TrainResult.shards``) joined into a plain checkpoint that resumes at ``first``.

    Raises:
        ValueError: shards missing or repeated (:func:`~parallel_lib.sharding.consolidate`), or
            saved for other trainable parameters.
    """
    model_state, optim_state = consolidate(shards)
    model = builder(run)
    freeze_parameters(model, run.freeze)
    dense_order = [n for n, p in model.named_parameters() if p.requires_grad]
    return (*to_dense(model_state, optim_state, shards[0]["trainable"], dense_order), first)


class _ReplicaForwards(nn.Module):
    """One step's forward of the global batch as a layout runs it: every replica's micro-batches, each
    with its own seeded dropout masks, their logits concatenated in row order."""

    def __init__(self, model: GPT2, dp: int, micro_batches: int, step: int) -> None:
        super().__init__()
        self.model, self.dp, self.micro_batches, self.steps = model, dp, micro_batches, step

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        stream, logits = self.model.dropout_stream, []
        for d, rows in enumerate(input_ids.chunk(self.dp)):  # replica d's rows (replica_rows)
            for i, part in enumerate(torch.tensor_split(rows, self.micro_batches)):
                stream.replica, stream.calls = d, self.steps * self.micro_batches + i  # call k·m + i + 1
                logits.append(self.model(part))
        self.steps += 1
        return torch.cat(logits)  # (B, T, V)


def _one_process(run: RunConfig, builder: ModelBuilder, dp: int, micro_batches: int, resume: Optional[Checkpoint],
                 stop: Optional[int] = None) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    run.check()
    positive_int("dp", dp)
    positive_int("micro_batches", micro_batches)
    model = builder(run)
    if run.experts:  # every MLP the run's mixture; each rank routes one micro-batch of its rows per forward
        model = mixture_of_experts(model, run, token_groups=dp * micro_batches)
    elif run.dropout:  # the one GPT-2's seeded masks, each replica's and micro-batch's own (see the module docstring)
        model = from_hf(model, run.seed)
    freeze_parameters(model, run.freeze)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(run, trainable)
    first = 0
    if resume is not None:
        model.load_state_dict(resume[0], strict=False)  # frozen parameters are not in a ZeRO checkpoint
        optimizer.load_state_dict(resume[1])
        first = resume[2]
    stepped = _ReplicaForwards(model, dp, micro_batches, first) if run.dropout else model

    def before_step(_: nn.Module) -> None:  # between backward and step
        if run.experts:  # an expert no token reached steps on zeros, as ZeRO's flat buffers make every layout do
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        if run.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable, run.max_grad_norm)

    record = train(stepped, optimizer, global_batches(run, dp)[first:stop], desc="one process",
                   average_gradients_fn=before_step if run.experts or run.max_grad_norm else None, progress=False)
    return record.losses, model, optimizer
