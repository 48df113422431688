"""The one training entry (chapters 05 and 10, and every equivalence proof): a plan of which
parallelism goes on which mesh axis (:class:`Plan`), the run (:class:`RunConfig`), the worker
:func:`train` that applies TP, then the pipeline split, then ZeRO over dp, and the one
single-process :func:`reference` every layout must equal.
"""

from parallel_lib.training.plan import Plan
from parallel_lib.training.one_process import reference
from parallel_lib.training.run import RunConfig, TrainResult, build_model, global_batches, train, train_many

__all__ = ["Plan", "RunConfig", "TrainResult", "train", "train_many", "reference", "build_model", "global_batches"]
