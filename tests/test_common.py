"""The shared argument checks and the markdown table: one message format, tested once."""

from __future__ import annotations

import math

import pytest

from parallel_lib.common.checks import check_choice, check_int, check_number, positive_int, positive_number
from parallel_lib.common.tables import markdown_table


@pytest.mark.parametrize("value", [0, -1, 2.5, "3", None, True, False])
def test_positive_int_refuses_what_is_not_a_count(value):
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got world_size="):
        positive_int("world_size", value)


def test_check_int_range_and_hint():
    assert check_int("rank", 3, minimum=0, maximum=3) == 3
    with pytest.raises(ValueError, match=r"rank must be an int in 0\.\.3, got rank=4; one per process"):
        check_int("rank", 4, minimum=0, maximum=3, hint="one per process")


@pytest.mark.parametrize("value", [0, -2.0, math.nan, math.inf, "1", True])
def test_positive_number_refuses_zero_nan_inf_and_non_numbers(value):
    with pytest.raises(ValueError, match="timeout must be"):
        positive_number("timeout", value)


def test_check_number_bounds():
    assert check_number("cost", 0, 0.0) == 0.0
    with pytest.raises(ValueError, match="cost must be > 0"):
        check_number("cost", 0, 0.0, strict=True)


def test_check_choice_lists_the_options():
    assert check_choice("schedule", "gpipe", ["gpipe", "1f1b"]) == "gpipe"
    with pytest.raises(ValueError, match=r"schedule must be one of \['gpipe', '1f1b'\], got schedule='GPipe'"):
        check_choice("schedule", "GPipe", ["gpipe", "1f1b"])


def test_markdown_table():
    assert markdown_table(["name", "ms"], [["a", 1.5], ["b", 2]], align="lr") == (
        "| name | ms |\n|---|---:|\n| a | 1.5 |\n| b | 2 |")
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        markdown_table(["name", "ms"], [["a"]])
    with pytest.raises(ValueError, match="align must be"):
        markdown_table(["name"], [], align="c")


def test_busy_machine_warning_only_when_even_the_ceiling_does_not_scale():
    from parallel_lib.common import busy_machine_warning

    assert busy_machine_warning(1.9, 2) == ""
    assert busy_machine_warning(3.0, 4) == ""
    warning = busy_machine_warning(1.2, 2)
    assert "1.20x" in warning and "2 workers" in warning
    assert busy_machine_warning(2.9, 4) != ""


def test_config_flags_follow_the_dataclass():
    import argparse
    from dataclasses import dataclass
    from typing import Optional

    from parallel_lib.common.cli import add_config_flags

    @dataclass
    class Config:
        steps: int = 3
        sync: str = "ring"
        overlap: bool = True
        limit: Optional[int] = None
        internal: int = 0

    parser = argparse.ArgumentParser()
    add_config_flags(parser, Config, skip=("internal",), choices=dict(sync=("ring", "naive")), types=dict(limit=int))
    assert vars(parser.parse_args([])) == dict(steps=3, sync="ring", overlap=True, limit=None)
    assert vars(parser.parse_args(["--steps", "5", "--no-overlap", "--limit", "7"]))["limit"] == 7
    with pytest.raises(SystemExit):
        parser.parse_args(["--sync", "tree"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--internal", "1"])
