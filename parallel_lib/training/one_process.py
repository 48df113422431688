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
"""

from __future__ import annotations

import torch
from torch import nn

from parallel_lib.common.checks import positive_int
from parallel_lib.common.training import train
from parallel_lib.models.gpt2 import GPT2
from parallel_lib.models.hf import from_hf
from parallel_lib.training.averagers import make_optimizer
from parallel_lib.training.batches import global_batches
from parallel_lib.training.run import ModelBuilder, RunConfig, build_model

__all__ = ["reference"]


class _ReplicaForwards(nn.Module):
    """One step's forward of the global batch as a layout runs it: every replica's micro-batches, each
    with its own seeded dropout masks, their logits concatenated in row order."""

    def __init__(self, model: GPT2, dp: int, micro_batches: int) -> None:
        super().__init__()
        self.model, self.dp, self.micro_batches, self.steps = model, dp, micro_batches, 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        stream, logits = self.model.dropout_stream, []
        for d, rows in enumerate(input_ids.chunk(self.dp)):  # replica d's rows (replica_rows)
            for i, part in enumerate(torch.tensor_split(rows, self.micro_batches)):
                stream.replica, stream.calls = d, self.steps * self.micro_batches + i  # call k·m + i + 1
                logits.append(self.model(part))
        self.steps += 1
        return torch.cat(logits)  # (B, T, V)


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
    model = builder(run)
    if run.dropout:  # the one GPT-2's seeded masks, each replica's and micro-batch's own (see the module docstring)
        model = from_hf(model, run.seed)
    stepped = _ReplicaForwards(model, dp, micro_batches) if run.dropout else model
    optimizer = make_optimizer(run, list(model.parameters()))
    record = train(stepped, optimizer, global_batches(run, dp), desc="one process", progress=False)
    return record.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
