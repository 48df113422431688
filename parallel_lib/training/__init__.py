"""The one training entry (chapters 05 and 10, and every equivalence proof): a plan of which
parallelism goes on which mesh axis (:class:`Plan`), the run (:class:`RunConfig`), the worker
:func:`train` that applies TP (and the cp axis's ring attention, the ep axis's experts:
:mod:`.experts`), then the pipeline split, then ZeRO over dp, and the one
single-process :func:`reference` every layout must equal; :func:`train_layout` / :func:`train_3d`
launch a plan from a notebook, :func:`measure_layout` measures one for the planner, and
:func:`tp_layout` says chapter 07's runs as plans, :mod:`.zero_measure` holds chapter 06's
measurements (:func:`zero_plan`: its data-parallel plans), and
:mod:`.traffic` holds the formulas of what each rank holds and sends (chapter 10).
"""

from parallel_lib.training.plan import Plan
from parallel_lib.training.data_axis import SYNCS
from parallel_lib.training.one_process import plain_checkpoint, reference, reference_checkpoint
from parallel_lib.training.batches import DATA_SOURCES, global_batches, replica_rows
from parallel_lib.training.run import RunConfig, TrainResult, build_model, train, train_many
from parallel_lib.training.tp_runs import tp_layout, train_tp
from parallel_lib.training.zero_measure import measure_stages, zero3_timelines, zero_plan
from parallel_lib.training.layouts import (LayoutMeasurement, job_record, job_step_times, max_difference,
                                           measure_layout, summarize_layout, train_3d, train_layout)
from parallel_lib.training.averagers import AVERAGERS
from parallel_lib.training.phases import PHASES

__all__ = ["Plan", "RunConfig", "TrainResult", "train", "train_many", "reference", "reference_checkpoint",
           "plain_checkpoint", "build_model", "global_batches",
           "replica_rows", "DATA_SOURCES", "SYNCS",
           "train_layout", "train_3d", "measure_layout", "summarize_layout", "LayoutMeasurement", "max_difference",
           "job_step_times", "job_record", "tp_layout", "train_tp", "zero_plan", "measure_stages", "zero3_timelines", "AVERAGERS",
           "PHASES"]
