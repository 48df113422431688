"""What a data-parallel run is checked against and summarised as.

:func:`single_process_reference` is the proof's other side: one process training on
the global batches the ranks see together, with the plain training loop; a DP run
must end with the same parameters. :func:`summarize` turns every rank's
:class:`~parallel_lib.data_parallel.dp.DPResult` into the numbers a reader compares.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from parallel_lib.common.training import TrainRecord, train
from parallel_lib.data.partition import global_batch_indices
from parallel_lib.data_parallel.dp import DPConfig, DPResult, prepare_replica

__all__ = ["single_process_reference", "summarize"]


def single_process_reference(world_size: int, config: DPConfig) -> tuple[TrainRecord, dict[str, torch.Tensor]]:
    """One process training on the global batches that ``world_size`` ranks see together.

    Step k's batch is every rank's batch k, in rank order (``global_batch_indices``),
    trained with the plain ``parallel_lib.common.training.train`` loop and its token-mean loss.

    Returns:
        (the per-step record, the final ``state_dict`` on the CPU).
    """
    model, optimizer, pairs, collate = prepare_replica(config, torch.device("cpu"))
    record = TrainRecord()
    for epoch in range(config.epochs):
        steps = global_batch_indices(pairs, world_size, config.batch_size, seed=config.data_seed, epoch=epoch)
        batches = [collate([pairs[i] for i in indices]) for indices in steps[:config.max_steps]]
        record.extend(train(model, optimizer, batches, progress=False))
    return record, {k: v.detach().clone() for k, v in model.state_dict().items()}


def summarize(results: Sequence[DPResult], warmup: int = 2) -> dict[str, Any]:
    """The numbers a reader compares between runs, from every rank's result.

    ``tokens_per_sec`` is the job's record's :meth:`~parallel_lib.common.training.TrainRecord.throughput`
    after ``warmup`` steps: NaN for a run no longer than its warm-up (``main`` says so in words).
    """
    first = results[0]
    return dict(sync=first.config.sync, world_size=first.world_size, model=first.model, device=first.device,
                steps=first.record.steps, tokens_per_sec=first.record.throughput(skip=warmup),
                epoch_times=[max(r.epoch_times[e] for r in results) for e in range(len(first.epoch_times))],
                final_loss=first.record.final_loss, val_loss=[r.val_loss for r in results],
                ranks_identical=len({r.checksum for r in results}) == 1)
