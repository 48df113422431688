"""Classroom exercises with self-checks, 2-3 per chapter notebook.

Each exercise is a stub cell the student fills in and a check cell that calls a
checker from here on the student's answer, for example::

    def _clock_cycles(num_batches, num_partitions):
        ...  # your code here

    from parallel_lib.exercises import check_clock_cycles
    check_clock_cycles(_clock_cycles)   # shows "✅ clock_cycles: passed 7 cases" or what is wrong

Checkers compare against the library's own functions (``get_device_map``,
``_clock_cycles``, ``training_memory``, ...), never raise on a wrong answer and show
the first failing case, expected vs got, and a hint. ``EXERCISES`` lists every
exercise by chapter (name, checker, stub source, reference solution), so the notebooks'
exercise cells and the tests are generated from one place; ``solutions`` holds the
reference answers.
"""

from __future__ import annotations

import importlib
from typing import Any

from parallel_lib.exercises._core import CheckResult, Exercise

# Checkers are imported on first use (PEP 562): chapter 02's checker runs in spawned ranks,
# which import this package, and should not pay for chapter 03's transformers import there.
_CHECKERS = {
    "check_rank_slice": "ch00", "check_all_reduce_prediction": "ch00",
    "check_partition_indices": "ch01", "check_local_batch_size": "ch01", "check_steps_per_epoch": "ch01",
    "check_wrong_dp_loop": "ch01",
    "check_average_token_gradients": "ch02", "check_ring_bytes_sent": "ch02", "check_ring_send_chunk": "ch02",
    "check_bucketed_allreduce": "ch02_overlap",
    "check_balanced_device_map": "ch03", "check_device_map_under_limit": "ch03", "check_training_bytes": "ch03",
    "check_clock_cycles": "ch04", "check_pipeline_bubble": "ch04", "check_gpipe_step_time": "ch04", "check_one_f_one_b_order": "ch04",
    "check_micro_batches_for_bubble": "ch04",
    "check_bytes_per_device": "ch05", "check_plan_parallelism": "ch05", "check_ring_exchange_order": "ch05",
    "check_shard_owner": "ch06", "check_zero_bytes_per_rank": "ch06", "check_zero3_bytes_sent": "ch06",
    "check_row_parallel_forward": "ch07", "check_tp_operators": "ch07", "check_vocab_cross_entropy": "ch07",
    "check_linear_weight_grad": "ch08a", "check_interleaved_bubble": "ch08a",
    "check_schedule_lab": "ch08b", "check_repair_deadlock": "ch08b",
}
CHAPTERS = ("00", "01", "02", "03", "04", "05", "06", "07", "08a", "08b")  # chapter 08 is two notebooks

_LAB = ("grade", "grade_notebook", "launch_cell", "section_cells", "hide_solutions")

__all__ = ["CheckResult", "Exercise", "EXERCISES", "CHAPTERS", "exercise", *_CHECKERS, *_LAB]


def __getattr__(name: str) -> Any:
    if name in _CHECKERS:
        return getattr(importlib.import_module(f".{_CHECKERS[name]}", __name__), name)
    if name in _LAB:
        return getattr(importlib.import_module(".lab", __name__), name)
    if name == "EXERCISES":
        # chapter (the notebook's number) -> its exercises, in the order they appear in the notebook
        return {chapter: importlib.import_module(f".ch{chapter}", __name__).EXERCISES for chapter in CHAPTERS}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def exercise(name: str) -> Exercise:
    """The exercise called ``name`` in any chapter.

    Raises:
        ValueError: no exercise has that name; the message lists them.
    """
    registry = __getattr__("EXERCISES")
    for exercises in registry.values():
        for item in exercises:
            if item.name == name:
                return item
    names = [item.name for exercises in registry.values() for item in exercises]
    raise ValueError(f"no exercise is called {name!r}; the exercises are {names}")


# chapter 09 (appended: the registries above stay as they were)
_CHECKERS.update({"check_largest_batch": "ch09", "check_gqa_decode_step": "ch09", "check_cache_step": "ch09",
                  "check_pipeline_throughput": "ch09"})
CHAPTERS = CHAPTERS + ("09",)
__all__ += ["check_largest_batch", "check_gqa_decode_step", "check_cache_step", "check_pipeline_throughput"]

# chapter 10 (appended: the registries above stay as they were)
_CHECKERS.update({"check_choose_layout": "ch10", "check_oom_term": "ch10"})
CHAPTERS = CHAPTERS + ("10",)
__all__ += ["check_choose_layout", "check_oom_term"]

# chapter 11 (appended: the registries above stay as they were)
_CHECKERS.update({"check_merge_attention": "ch11", "check_zigzag_positions": "ch11", "check_busiest_share": "ch11"})
CHAPTERS = CHAPTERS + ("11",)
__all__ += ["check_merge_attention", "check_zigzag_positions", "check_busiest_share"]

# chapter 12 (appended: the registries above stay as they were)
_CHECKERS.update({"check_dispatch_rows": "ch12", "check_combine_rows": "ch12", "check_balance_effect": "ch12"})
CHAPTERS = CHAPTERS + ("12",)
__all__ += ["check_dispatch_rows", "check_combine_rows", "check_balance_effect"]

# chapter 10b, the bug hunt (appended: the registries above stay as they were)
_CHECKERS.update({"check_bug_hunt_1": "ch10b", "check_bug_hunt_2": "ch10b", "check_bug_hunt_3": "ch10b",
                  "check_diagnosis": "ch10b"})
CHAPTERS = CHAPTERS + ("10b",)
__all__ += ["check_bug_hunt_1", "check_bug_hunt_2", "check_bug_hunt_3", "check_diagnosis"]

# chapter 13 (appended: the registries above stay as they were)
_CHECKERS.update({"check_block_slot": "ch13", "check_admit_requests": "ch13", "check_accept_draft": "ch13"})
CHAPTERS = CHAPTERS + ("13",)
__all__ += ["check_block_slot", "check_admit_requests", "check_accept_draft"]
