"""Combining strategies (chapter 05): a stage's gradients (tied sum, bucketed dp mean), data
parallelism over pipelines and its results. The ranks' layout and groups are the one
:class:`~parallel_lib.runtime.mesh.Mesh`. Chapter 10's DP x TP x PP is a plan of the one
training entry, :func:`parallel_lib.training.train` (its formulas: :mod:`parallel_lib.training.traffic`).
"""

from parallel_lib.hybrid.dp_pp import HybridConfig, run_hybrid, run_hybrid_many
from parallel_lib.hybrid.gradients import StageGradients
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
]
