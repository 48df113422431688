"""The one single-process reference: the dense model on the whole global batch, no parallelism.

Independent of every parallel code path: Part I's plain training loop
(:func:`parallel_lib.common.training.train`: Hugging Face's ``GPT2LMHeadModel`` forward with
its causal attention and tied head, the course's weighted loss ``sum(ce · w) / sum(w)``, one
optimizer step per batch) with the run's optimizer (``torch.optim.AdamW``, or SGD). Every layout
of :func:`~parallel_lib.training.run.train` must reach the parameters this reaches.

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

from parallel_lib.common.training import train
from parallel_lib.models.hf import from_hf
from parallel_lib.training.averagers import make_optimizer
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
    optimizer = make_optimizer(run, list(model.parameters()))
    record = train(model, optimizer, global_batches(run, dp), desc="one process", progress=False)
    return record.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
