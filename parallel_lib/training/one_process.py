"""The one single-process reference: the dense model on the whole global batch, AdamW, no parallelism.

Independent of every parallel code path: Hugging Face's ``GPT2LMHeadModel`` forward (causal
attention, its own tied head), the course's weighted loss ``sum(ce · w) / sum(w)`` and
``torch.optim.AdamW`` with the run's settings. Every layout of :func:`~parallel_lib.training.run.train`
must reach the parameters this reaches.

With dropout, Hugging Face's masks come from torch's global random stream, which no parallel
run can reproduce; the reference then runs the one GPT-2 (:mod:`parallel_lib.models`, equal to
Hugging Face's without dropout, tests/test_gpt2_model.py) with the run's seed, whose seeded
masks (:mod:`parallel_lib.models.dropout`) are numbered by replica and forward call, as the
parallel run numbers them: each of the ``dp`` replicas' rows runs with its replica's masks, cut
into ``micro_batches`` forwards (micro-batch ``i`` of step ``k`` is call ``k · micro_batches + i + 1``,
as :func:`~parallel_lib.training.step.pipeline_step` numbers it). With one replica and one
micro-batch that is one forward of the whole batch per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_lib.common.checks import positive_int
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import from_hf
from parallel_lib.training.batches import global_batches, replica_rows
from parallel_lib.training.run import ModelBuilder, RunConfig, build_model

__all__ = ["reference"]


def reference(run: RunConfig = RunConfig(), builder: ModelBuilder = build_model, dp: int = 1,
              micro_batches: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of every step and the final parameters (state-dict names) of one process.

    Args:
        run: the run (model, batches, optimizer) every layout trains.
        builder: builds the dense model from ``run``.
        dp: the replicas of the layout it stands for (the corpus source orders each global
            batch's rows by replica, :func:`~parallel_lib.training.batches.global_batches`; with
            dropout each replica draws its own masks).
        micro_batches: the micro-batches each replica's rows are cut into (only dropout's masks,
            numbered by forward, depend on it).

    Raises:
        ValueError: see :meth:`RunConfig.check`; ``dp`` or ``micro_batches`` below 1.
    """
    run.check()
    positive_int("dp", dp)
    positive_int("micro_batches", micro_batches)
    if run.dropout:  # the one GPT-2's seeded masks, each replica's and micro-batch's own (see the module docstring)
        return _with_seeded_dropout(from_hf(builder(run), run.seed), run, dp, micro_batches)
    model = builder(run)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, eps=run.eps, weight_decay=run.weight_decay)
    losses = []
    for batch in global_batches(run, dp):
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"])
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        weights = batch["label_token_weights"].flatten()
        loss = (ce * weights).sum() / weights.sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _with_seeded_dropout(model: GPT2, run: RunConfig, dp: int, micro_batches: int
                         ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """:func:`reference` with dropout: per step, each replica's micro-batches with their own masks, one gradient."""
    model.train()
    stream = model.dropout_stream
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, eps=run.eps, weight_decay=run.weight_decay)
    losses = []
    for k, batch in enumerate(global_batches(run, dp)):
        optimizer.zero_grad(set_to_none=True)
        total, loss = batch["label_token_weights"].sum(), 0.0
        for d in range(dp):
            rows = {key: torch.tensor_split(v, micro_batches) for key, v in replica_rows(batch, d, dp).items()}
            for i in range(micro_batches):
                stream.replica, stream.calls = d, k * micro_batches + i  # the forward counts call k·m + i + 1
                logits = model(rows["input_ids"][i])
                ce = F.cross_entropy(logits.flatten(0, 1), rows["labels"][i].flatten(), reduction="none")
                share = (ce * rows["label_token_weights"][i].flatten()).sum() / total
                share.backward()
                loss += share.item()
        optimizer.step()
        losses.append(loss)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
