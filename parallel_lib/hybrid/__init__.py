"""Combining strategies (chapter 05): a stage's gradients (tied sum, bucketed dp mean), data
parallelism over pipelines and its results; (chapter 10) DP x TP x PP, its run, its traffic
formulas and ``measure_layout``. The ranks' layout and groups are the one
:class:`~parallel_lib.runtime.mesh.Mesh`.
"""

from parallel_lib.hybrid.dp_pp import HybridConfig, run_hybrid, run_hybrid_many
from parallel_lib.hybrid.dp_tp_pp import Config3D, Result3D, run_3d, run_3d_many
from parallel_lib.hybrid.gradients import StageGradients
from parallel_lib.hybrid.layout3d import LayoutMeasurement, max_difference, measure_layout, reference_3d, train_3d
from parallel_lib.hybrid.results import HEAD_COPY, HybridResult, compare_with_reference, gather_state, summarize

__all__ = [
    "HybridConfig",
    "HybridResult",
    "run_hybrid",
    "run_hybrid_many",
    "summarize",
    "gather_state",
    "compare_with_reference",
    "HEAD_COPY",
    "StageGradients",
    "Config3D",
    "Result3D",
    "run_3d",
    "run_3d_many",
    "train_3d",
    "measure_layout",
    "LayoutMeasurement",
    "reference_3d",
    "max_difference",
]
