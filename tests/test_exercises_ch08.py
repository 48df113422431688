"""Chapter 08's exercises: the schedule lab and the split backward's W, each wrong answer named.

Every wrong answer is written as a student would write it; each test asserts the name the
checker gives the mistake, so a checker that stops recognising one fails here.
"""

import subprocess
import sys
import textwrap

import pytest

from parallel_lib.exercises import check_linear_weight_grad, check_repair_deadlock, check_schedule_lab
from parallel_lib.exercises.ch08_schedule_lab import BUBBLE_TARGET, COSTS, PEAK_LIMIT, as_lab_schedule
from parallel_lib.pipeline_parallel import make_schedule, simulate_schedule
from tests.test_exercises import notebook_function

# a correct answer (not the reference in solutions.py): bubble 1/16 at a peak of 5
GOOD = ["F0 F1 F2 F3 F4 B0 W0 B1 B2 F5 W1 B3 B4 F6 W2 F7 W3 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 F2 F3 F4 B0 W0 B1 B2 W1 B3 B4 F5 W2 F6 W3 B5 F7 W4 B6 W5 B7 W6 W7",
        "F0 F1 F2 B0 F3 B1 F4 B2 W0 B3 B4 W1 F5 W2 B5 F6 W3 B6 F7 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 W0 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"]
# a cost-aware greedy allowed 6 micro-batches: bubble 1/32, but above the memory limit
GREEDY_6 = ["F0 F1 F2 F3 F4 F5 B0 W0 B1 F6 B2 B3 W1 F7 B4 B5 W2 W3 B6 W4 B7 W5 W6 W7",
            "F0 F1 F2 F3 F4 B0 F5 B1 W0 B2 B3 F6 W1 B4 B5 F7 W2 B6 W3 B7 W4 W5 W6 W7",
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 W0 B4 B5 F6 W1 B6 F7 W2 B7 W3 W4 W5 W6 W7",
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 W0 F6 B6 W1 F7 B7 W2 W3 W4 W5 W6 W7"]


def _replace(rows, rank, old, new):
    rows = list(rows)
    assert old in rows[rank]
    rows[rank] = rows[rank].replace(old, new, 1)
    return rows


def test_the_lab_costs_defeat_every_built_in_schedule():
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        schedule = make_schedule(name, 4, 8)
        result = simulate_schedule(schedule, COSTS if schedule.split_backward else (COSTS[0], COSTS[1] + COSTS[2]))
        assert result.bubble > BUBBLE_TARGET or max(result.peak_in_flight) > PEAK_LIMIT, name
        assert f"this is the library's {name}, pasted in" in check_schedule_lab(schedule).message
    for name in ("interleaved", "zbv", "dualpipev"):  # two stages per rank: another model cut
        assert "one model stage per rank" in check_schedule_lab(make_schedule(name, 4, 8)).message


@pytest.mark.parametrize("answer", [GOOD, [f"rank {r}: {row}" for r, row in enumerate(GOOD)],
                                    as_lab_schedule(GOOD), [row.split() for row in GOOD]])
def test_a_correct_schedule_passes_on_the_simulator_and_the_pipe(answer):
    result = check_schedule_lab(answer)
    assert result.passed, result.message
    assert "bubble 0.062 <= 0.07 at 5 <= 5" in result.message and "every gradient equals" in result.message


def _built_in(name):
    return [row.split(": ")[1] for row in str(make_schedule(name, 4, 8)).splitlines()[1:]]


@pytest.mark.parametrize("answer, fragments", [
    (_replace(_replace(GOOD, 1, "F0 F1", "B0 F1"), 1, "F4 B0", "F4 F0"),
     ["a backward before its forward: rank 1 runs B0 before F0", "move that micro-batch's B after its F"]),
    (_replace(_replace(GOOD, 3, "F0 B0", "F0 W0 B0"), 3, "B4 W0", "B4"),
     ["a weight gradient before its input gradient: rank 3 runs W0 before B0", "a W may wait, never lead"]),
    (_replace(GOOD, 0, "F0 F1 F2 F3 F4 B0 W0", "F0 B0 W0 F1 F2 F3 F4"),
     ["the ranks wait on each other (a dependency cycle)", "find the two ranks"]),
    (_built_in("zb-h1"), ["this is the library's zb-h1, pasted in", "bubble is 0.094", "drawn for F = B = W"]),
    (_built_in("zb-h2"), ["this is the library's zb-h2, pasted in", "holds up to 7 micro-batches"]),
    (GREEDY_6, ["meets the bubble (0.031 <= 0.07) but not the memory target", "[6.0, 6.0, 6.0, 6.0]",
                "where could a W run earlier"]),
    ([" ".join(f"F{i}" for i in range(8)) + " " + " ".join(f"B{i}" for i in range(8))] * 4,
     ["the backward is not split: no rank runs a W"]),
    (_replace(GOOD, 0, "F0 F1", "F1 F0"), ["the bubble is 0.094, above the target 0.07", "rank 0 idles 3 time units inside its span",
                                            "the longest wait"]),
    (GOOD[:3], ["4 ranks and micro-batches 0..7, got 3 rank(s)"]),
    ("F0 B0 W0", ["a list of 4 strings, one per rank"]),
    (["F0 X1"] * 4, ['actions written like "F0"', "got 'X1'"]),
])
def test_wrong_schedules_are_named(answer, fragments):
    result = check_schedule_lab(answer)
    assert not result.passed and result.message.startswith("❌ schedule_lab")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_the_repaired_deadlock_passes_the_blocking_check():
    assert check_repair_deadlock("F0 B0 F1 B1").passed
    assert "does not run" in check_repair_deadlock("F0 F1 B1 B0").message
    assert "every stage waits" in check_repair_deadlock("F0 F1 B0 B1").message


GOOD_W = """
    def linear_weight_grad(x, grad_y):
        g, inputs = grad_y.flatten(0, -2), x.flatten(0, -2)
        return g.T @ inputs, g.sum(dim=0)
"""


@pytest.mark.parametrize("source, fragments", [
    (GOOD_W, None),
    ("""
        def linear_weight_grad(x, grad_y):
            g, inputs = grad_y.flatten(0, -2), x.flatten(0, -2)
            return inputs.T @ g, g.sum(0)          # transposed
     """, ["grad_weight has shape (3, 4), autograd's has (4, 3)", "the weight's shape (out, in)"]),
    ("""
        def linear_weight_grad(x, grad_y):
            g, inputs = grad_y.flatten(0, -2), x.flatten(0, -2)
            return g.T @ inputs, g                  # the bias's gradient not summed
     """, ["grad_bias has shape (5, 4), autograd's has (4,)", "sums grad_y over every row"]),
    ("""
        def linear_weight_grad(x, grad_y):
            return grad_y.transpose(-1, -2) @ x, grad_y.sum(0)   # a 2-D answer on a batch of sequences
     """, ["x of shape (2, 6, 3)", "grad_weight has shape (2, 4, 3)", "flatten them first"]),
    ("""
        def linear_weight_grad(x, grad_y):
            g, inputs = grad_y.flatten(0, -2), x.flatten(0, -2)
            return g.T @ inputs / len(g), g.mean(0)              # a mean
     """, ["grad_weight differs from autograd's", "so sum"]),
    ("""
        def linear_weight_grad(x, grad_y):
            if x.requires_grad or x.grad_fn is not None:        # fine on leaves, wrong inside a model
                return None, None
            g, inputs = grad_y.flatten(0, -2), x.flatten(0, -2)
            return g.T @ inputs, g.sum(0)
     """, ["the ZB-H1 Pipe"]),
])
def test_linear_weight_grad_answers(source, fragments):
    result = check_linear_weight_grad(notebook_function(source))
    assert result.passed == (fragments is None), result.message
    for fragment in fragments or ():
        assert fragment in result.message, result.message


def test_after_hide_solutions_the_answers_are_gone_and_the_checkers_still_run(tmp_path):
    """A copy of the package, solutions.py removed by the command a teacher runs: nothing to import, checks run."""
    import shutil

    import parallel_lib
    from pathlib import Path
    copy = tmp_path / "parallel_lib"
    shutil.copytree(Path(parallel_lib.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    script = textwrap.dedent(f"""
        import importlib, sys
        from parallel_lib.exercises.__main__ import main
        assert main(["hide-solutions"]) == 0
        try:
            importlib.import_module("parallel_lib.exercises.solutions")
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("solutions.py is still importable")
        from parallel_lib.exercises import EXERCISES, check_schedule_lab, check_linear_weight_grad
        from parallel_lib.exercises._core import HIDDEN
        for chapter in ("08a", "08b"):
            assert all(item.solution is HIDDEN for item in EXERCISES[chapter]), chapter
        assert check_schedule_lab({GOOD!r}).passed
        assert not check_schedule_lab(None).passed
        ns = {{}}
        exec({textwrap.dedent(GOOD_W)!r}, ns)
        assert check_linear_weight_grad(ns["linear_weight_grad"]).passed
        print("hidden and checked")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "hidden and checked" in done.stdout
    assert not (copy / "exercises" / "solutions.py").exists()


@pytest.mark.parametrize("chapter", ["08a", "08b"])
def test_each_half_of_chapter_08_ends_with_its_exercise_cells_and_grade_cell(chapter):
    import glob

    import nbformat

    from parallel_lib.exercises.lab import SECTION_HEADING, section_cells
    (path,) = glob.glob(f"notebooks/{chapter}_*.ipynb")
    cells = nbformat.read(path, as_version=4).cells
    start = next(k for k, c in enumerate(cells) if c.source.startswith(SECTION_HEADING))
    assert [c.source for c in cells[start:]] == [c.source for c in section_cells(chapter)]
    assert cells[-1].source == f"from parallel_lib.exercises import grade\n\ngrade({chapter!r}, globals())"
    sources = [c.source for c in cells]
    proof = next(k for k, s in enumerate(sources) if "gradients equal the unsplit model's" in s)
    widget = next(k for k, s in enumerate(sources) if s.startswith("schedule_widget("))
    assert proof < widget  # the proof before the widget


def test_grade_notebook_scores_08b_filled_with_the_answers(tmp_path):
    import glob

    import nbformat

    from parallel_lib.exercises import EXERCISES, grade_notebook
    from parallel_lib.exercises import solutions
    (path,) = glob.glob("notebooks/08b_*.ipynb")
    assert [r.passed for r in grade_notebook(path)] == [False, False]
    nb = nbformat.read(path, as_version=4)
    answers = {"schedule_lab": solutions.SCHEDULE_LAB, "repair_deadlock": solutions.REPAIR_DEADLOCK}
    for item in EXERCISES["08b"]:
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source == item.stub.rstrip("\n"))
        cell.source = f"{item.answer_name} = {answers[item.answer_name]!r}"
    filled = tmp_path / "08b_filled.ipynb"
    nbformat.write(nb, filled)
    assert [r.passed for r in grade_notebook(filled)] == [True, True]
