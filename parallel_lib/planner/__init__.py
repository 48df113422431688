"""Choosing a strategy (chapter 05): the planner behind the decision widget, and the measured
comparison behind the article's table 3; and (chapter 10) the calibrated planner: every
dp × tp × pp layout priced from this machine's measurements (``layout``, ``search``, ``calibrate``),
with published GPU figures and published training runs beside it (``hardware``, ``published``); and
(chapter 12) a mixture-of-experts model on those layouts with an ``ep`` axis (``experts``).
"""

from parallel_lib.planner.calibrate import Calibration
from parallel_lib.planner.calibration_cache import load_or_calibrate
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
from parallel_lib.planner.experts import EPPlan, EPPriced, Experts, plan_ep, price_ep
from parallel_lib.planner.layout import Layout, Priced, StepCost, price
from parallel_lib.planner.search import LayoutPlan, plan_layouts

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
    "Calibration",
    "load_or_calibrate",
    "Layout",
    "Priced",
    "StepCost",
    "price",
    "LayoutPlan",
    "plan_layouts",
    "Experts",
    "EPPriced",
    "EPPlan",
    "price_ep",
    "plan_ep",
]
