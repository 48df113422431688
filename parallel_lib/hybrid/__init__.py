"""Combining strategies (chapter 05): the rank grid and its process groups, a stage's
gradients (tied sum, bucketed dp mean), data parallelism over pipelines and its results.
"""

from parallel_lib.hybrid.dp_pp import HybridConfig, run_hybrid, run_hybrid_many
from parallel_lib.hybrid.gradients import StageGradients
from parallel_lib.hybrid.grid import RankGrid, new_groups
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
    "RankGrid",
    "new_groups",
    "StageGradients",
]
