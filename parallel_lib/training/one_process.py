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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_lib.models.hf import from_hf
from parallel_lib.training.batches import global_batches
from parallel_lib.training.run import ModelBuilder, RunConfig, build_model

__all__ = ["reference"]


def reference(run: RunConfig = RunConfig(), builder: ModelBuilder = build_model, dp: int = 1
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of every step and the final parameters (state-dict names) of one process.

    ``dp``: the replicas of the layout it stands for (the corpus source orders each global
    batch's rows by replica; :func:`~parallel_lib.training.batches.global_batches`).
    """
    run.check()
    model = builder(run)
    if run.dropout:  # the one GPT-2's seeded masks, numbered by forward call (see the module docstring)
        model = from_hf(model, run.seed)
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
