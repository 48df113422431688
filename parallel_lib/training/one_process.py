"""The one single-process reference: the dense model on the whole global batch, AdamW, no parallelism.

Independent of every parallel code path: Hugging Face's ``GPT2LMHeadModel`` forward (causal
attention, its own tied head), the course's weighted loss ``sum(ce · w) / sum(w)`` and
``torch.optim.AdamW`` with the run's settings. Every layout of :func:`~parallel_lib.training.run.train`
must reach the parameters this reaches.

With dropout, Hugging Face's masks come from torch's global random stream, which no parallel
run can reproduce; the reference then runs the one GPT-2 (:mod:`parallel_lib.models`, equal to
Hugging Face's without dropout, tests/test_gpt2_model.py) with the run's seed, whose seeded
masks (:mod:`parallel_lib.models.dropout`) are numbered by forward call: step ``k`` is call
``k + 1``, as :func:`~parallel_lib.training.step.pipeline_step` numbers a step of one
micro-batch. A parallel run with dropout equals this one when it has one replica (``dp = 1``)
and one micro-batch: otherwise its masks are drawn for the replica's or micro-batch's rows.

Chapter 06's options hold here too: ``run.freeze`` leaves those parameters out of AdamW,
``run.max_grad_norm`` clips with torch's ``clip_grad_norm_``, and a plain checkpoint
(:mod:`.checkpoints`) is saved (:func:`reference_checkpoint`) and continued (``resume=``) here;
:func:`plain_checkpoint` turns ZeRO's shards into one.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lib.common.checks import check_int
from parallel_lib.models.hf import from_hf
from parallel_lib.sharding.checkpoint import consolidate
from parallel_lib.training.batches import global_batches
from parallel_lib.training.checkpoints import Checkpoint, to_dense
from parallel_lib.training.run import ModelBuilder, RunConfig, build_model
from parallel_lib.training.zero_options import freeze_parameters

__all__ = ["reference", "reference_checkpoint", "plain_checkpoint"]


def reference(run: RunConfig = RunConfig(), builder: ModelBuilder = build_model, dp: int = 1,
              resume: Optional[Checkpoint] = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of every step and the final parameters (state-dict names) of one process.

    ``dp``: the replicas of the layout it stands for (the corpus source orders each global
    batch's rows by replica; :func:`~parallel_lib.training.batches.global_batches`).
    ``resume``: a plain checkpoint to continue from (the losses are those of the steps run).
    """
    losses, model, _ = _one_process(run, builder, dp, resume)
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
    _, model, optimizer = _one_process(run, builder, 1, None, stop=steps)
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


def _one_process(run: RunConfig, builder: ModelBuilder, dp: int, resume: Optional[Checkpoint],
                 stop: Optional[int] = None) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    run.check()
    model = builder(run)
    if run.dropout:  # the one GPT-2's seeded masks, numbered by forward call (see the module docstring)
        model = from_hf(model, run.seed)
    freeze_parameters(model, run.freeze)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=run.lr, eps=run.eps, weight_decay=run.weight_decay)
    first = 0
    if resume is not None:
        model.load_state_dict(resume[0], strict=False)  # frozen parameters are not in a ZeRO checkpoint
        optimizer.load_state_dict(resume[1])
        first = resume[2]
    losses = []
    for batch in global_batches(run, dp)[first:stop]:
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"])
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        weights = batch["label_token_weights"].flatten()
        loss = (ce * weights).sum() / weights.sum()
        loss.backward()
        if run.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable, run.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses, model, optimizer
