"""Chapter 07's runs as plans of the one training entry: a :class:`TPConfig` becomes (plan, run).

Chapter 07 trains GPT-2 split by heads over ``tp`` ranks, the rest of the world data parallel
(``dp = world_size / tp``), every replica taking ``batch_size`` rows of each step in one
micro-batch. :func:`tp_layout` says that as a :class:`Plan` and a :class:`RunConfig`;
:func:`~parallel_lib.training.train` runs it on every rank and
:func:`~parallel_lib.training.reference` ``(run, dp=dp)`` is the one process it must equal (with
dropout, each replica's rows with that replica's masks); :func:`train_tp` is
the worker for a launch that knows its world size only inside the ranks (torchrun, the CLI).
"""

from __future__ import annotations

from parallel_lib.common.checks import positive_int
from parallel_lib.tensor_parallel.batches import TPConfig
from parallel_lib.training.plan import Plan
from parallel_lib.training.run import RunConfig, TrainResult, train

__all__ = ["tp_layout", "train_tp"]


def tp_layout(config: TPConfig, world_size: int, return_state: bool = True) -> tuple[Plan, RunConfig]:
    """The plan (tp × dp, one micro-batch) and the run of ``config`` on ``world_size`` ranks.

    Args:
        config: chapter 07's run (``tp=0``: every rank in one tensor-parallel group).
        world_size: the ranks of the launch.
        return_state: whether the ranks send their trained parameters back.

    Raises:
        ValueError: ``world_size`` below 1, a model :meth:`TPConfig.check` refuses, or a ``tp`` that does
            not divide the world size (named in the message).
    """
    positive_int("world_size", world_size)
    config.check()
    tp = config.tp or world_size
    if world_size % tp:
        raise ValueError(f"tp={tp} must divide world_size={world_size}: choose a world size that is a multiple of tp")
    dp = world_size // tp
    plan = Plan(dp=dp, tp=tp, sequence_parallel=config.sequence_parallel, micro_batches=1)
    run = RunConfig(model=config.model, n_layer=config.n_layer, n_embd=config.n_embd, vocab_size=config.vocab_size,
                    seq_len=config.seq_len, batch_size=config.batch_size * dp, steps=config.steps, lr=config.lr,
                    seed=config.seed, dropout=config.dropout, padding=config.padding, return_state=return_state)
    return plan, run


def train_tp(rank: int, world_size: int, config: TPConfig, return_state: bool = True) -> TrainResult:
    """:func:`~parallel_lib.training.train` of :func:`tp_layout` ``(config, world_size)``: the worker for ``launch``.

    Raises:
        ValueError: see :func:`tp_layout` and :func:`~parallel_lib.training.run.check_layout`.
    """
    return train(rank, world_size, *tp_layout(config, world_size, return_state))
