"""#22 item 6: a NaN or an infinity fails every comparison in the course.

``worst > tol`` is False for a NaN, and Python's ``max(0.0, nan)`` is 0.0: a run whose
parameters had gone NaN "matched one process". Each comparison helper is given a NaN (or an
infinity on both sides, which ``torch.testing.assert_close`` calls equal) and must report it.
The command line's ``--check`` on a diverging run is in tests/test_tp_cli.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.training import TrainRecord
from parallel_lib.data_parallel.ring_cost import allreduce_cost
from parallel_lib.gpu_checks._reference import CheckError
from parallel_lib.gpu_checks._reference import max_difference as gpu_max_difference
from parallel_lib.tensor_parallel.verify import diff
from parallel_lib.training import Plan, train_3d
from parallel_lib.training import max_difference as training_max_difference
from parallel_lib.training.run import TrainResult

NAN, INF = float("nan"), float("inf")


def test_max_abs_difference_is_the_largest_gap_and_inf_for_anything_not_finite():
    assert max_abs_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 1.0])) == 1.0
    assert max_abs_difference([4.0], [4.0]) == 0.0 and max_abs_difference(torch.empty(0), torch.empty(0)) == 0.0
    for got, expected in [([NAN, 1.0], [1.0, 1.0]), ([1.0], [NAN]), ([INF], [INF]), ([-INF, 0.0], [-INF, 0.0])]:
        assert max_abs_difference(got, expected) == math.inf, (got, expected)
    with pytest.raises(ValueError, match=r"cannot compare a \(2,\) result with a \(3,\) reference"):
        max_abs_difference(torch.zeros(2), torch.zeros(3))


def _rank(state: dict[str, torch.Tensor]) -> TrainResult:
    return TrainResult(0, {"dp": 0, "tp": 0, "pp": 0}, Plan(), TrainRecord(), {}, {}, 0, 0, state=state)


def test_training_max_difference_reports_a_nan_parameter_as_infinite():
    reference = {"w": torch.zeros(3), "b": torch.zeros(2)}
    results = [_rank({"w": torch.zeros(3), "b": torch.zeros(2)}), _rank({"w": torch.tensor([0.0, NAN, 0.0]),
                                                                         "b": torch.zeros(2)})]
    assert training_max_difference(results, reference) == {"w": math.inf, "b": 0.0}  # was {"w": 0.0}


def test_tensor_parallel_exactness_checks_report_nan_as_infinite():
    assert diff(torch.tensor([1.0, NAN]), torch.tensor([1.0, 2.0])) == math.inf  # was nan: nan < 1e-5 is False,
    assert diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == 0.5      # but a notebook printed "nan"


def test_gpu_checks_refuse_infinities_that_assert_close_calls_equal():
    expected = (torch.tensor(INF), {"w": torch.ones(2)})
    with pytest.raises(CheckError, match="infinite here and in the reference"):
        gpu_max_difference(expected, (torch.tensor(INF), {"w": torch.ones(2)}), "2 devices")
    with pytest.raises(CheckError, match="does not match the reference"):
        gpu_max_difference(expected, (torch.tensor(NAN), {"w": torch.ones(2)}), "2 devices")
    assert gpu_max_difference((torch.tensor(1.0), {"w": torch.ones(2)}), (torch.tensor(1.0), {"w": torch.ones(2)}),
                              "2 devices") == 0.0


def _every_exercise():
    from parallel_lib.exercises import EXERCISES

    return [item for items in EXERCISES.values() for item in items]


def _nan_in_place_of_numbers(value):
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return NAN
    if isinstance(value, (list, tuple)):
        return type(value)(_nan_in_place_of_numbers(v) for v in value)
    return {k: _nan_in_place_of_numbers(v) for k, v in value.items()} if isinstance(value, dict) else value


@pytest.mark.parametrize("item", [i for i in _every_exercise() if not callable(i.solution)
                                  and _nan_in_place_of_numbers(i.solution) != i.solution
                                  and i.name != "all_reduce_prediction"],  # its checker launches ranks: 17 s
                         ids=lambda i: i.name)
def test_an_exercise_answered_with_nan_fails_with_a_message_that_says_why(item):
    result = item.check(_nan_in_place_of_numbers(item.solution))
    assert not result.passed and "nan" in result.message and "cannot convert" not in result.message, result.message


@pytest.mark.parametrize("item", [i for i in _every_exercise() if callable(i.solution)
                                  and i.name not in ("average_token_gradients", "bucketed_allreduce")],
                         ids=lambda i: i.name)
def test_an_exercise_function_returning_nan_fails(item):
    import inspect

    parameters = ", ".join(inspect.signature(item.solution).parameters)
    namespace: dict = {}
    exec(f"def {item.answer_name}({parameters}):\n    return float('nan')\n", namespace)  # no ranks are started:
    assert not item.check(namespace[item.answer_name]).passed  # the checkers fail NaN before any launch


@pytest.mark.parametrize("call, match", [
    (lambda: train_3d(1, 1, 1, lr=NAN), "lr must be finite, got lr=nan"),  # #22 item 10: before any rank starts
    (lambda: allreduce_cost(1e6, 2, NAN, 0.0), "bandwidth must be finite"),  # was a NaN cost
    (lambda: allreduce_cost(NAN, 2, 1e9, 0.0), "nbytes must be finite"),
])
def test_a_nan_setting_is_refused_before_it_can_make_a_nan_result(call, match):
    with pytest.raises(ValueError, match=match):
        call()
