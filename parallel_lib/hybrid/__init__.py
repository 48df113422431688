"""Combining strategies (chapter 05): the rank grid and its process groups, and data
parallelism over pipelines.
"""

from parallel_lib.hybrid.dp_pp import (
    HEAD_COPY,
    HybridConfig,
    HybridResult,
    compare_with_reference,
    gather_state,
    run_hybrid,
    run_hybrid_many,
    summarize,
)
from parallel_lib.hybrid.grid import RankGrid

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
]
