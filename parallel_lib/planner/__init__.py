"""One planner. Chapter 05's named strategies (``strategy``: DP, MP, PP, DP×PP, ZeRO, TP×DP, each a
:class:`Layout`) behind the decision widget, and the measured comparison behind the article's table 3;
chapter 10's search over every dp × tp × pp layout (``search``); both priced by one function,
:func:`~parallel_lib.planner.layout.price` (memory, traffic, time, overlap, links), from this machine's
measurements (``calibrate``) or published GPU figures (``hardware``), with published training runs
beside them (``published``); and
(chapter 12) a mixture-of-experts model on those layouts with an ``ep`` axis (``experts``).
"""

from parallel_lib.planner.calibrate import Calibration
from parallel_lib.planner.calibration_cache import load_or_calibrate
from parallel_lib.planner.compare import CLASSIC, CompareConfig, Measured, markdown_table, measure
from parallel_lib.planner.strategy import PART_ONE, STRATEGIES, WHEN_TO_USE, Option, Plan, fewest_stages, plan
from parallel_lib.planner.experts import EPPlan, EPPriced, Experts, plan_ep, price_ep
from parallel_lib.planner.layout import Layout, Priced, StepCost, p2p_bytes, price
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
