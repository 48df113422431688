"""Choosing a strategy (chapter 05): the planner behind the decision widget, and the measured
comparison behind the article's table 3.
"""

from parallel_lib.planner.compare import CLASSIC, CompareConfig, Measured, markdown_table, measure
from parallel_lib.planner.strategy import (
    PART_ONE,
    STRATEGIES,
    WHEN_TO_USE,
    Option,
    Plan,
    fewest_stages,
    p2p_bytes,
    plan,
    ring_bytes,
)

__all__ = [
    "CompareConfig",
    "Measured",
    "CLASSIC",
    "measure",
    "markdown_table",
    "PART_ONE",
    "STRATEGIES",
    "WHEN_TO_USE",
    "Option",
    "Plan",
    "plan",
    "fewest_stages",
    "ring_bytes",
    "p2p_bytes",
]
