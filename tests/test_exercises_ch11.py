"""Chapter 11's exercises: each checker passes the reference and names the typical wrong answers.

The merge runs as one ring step on 2 gloo ranks, so each of its answers is one launch: the reference
and the four mistakes the chapter warns about (a plain average, weighting by the lse themselves,
weights that do not add up to 1, exp without the shift by the maximum). Wrong answers are written
as a student writes them in a notebook cell (``notebook_function``), so the checker ships them to its
ranks exactly as from a kernel.
"""

import pytest

from parallel_lib import exercises
from parallel_lib.exercises import EXERCISES
from test_exercises import notebook_function  # the same module pytest collects: one counter of cell names

# ----------------------------------------------------------------------------- the log-sum-exp merge, on ranks

_MERGE = '''
import torch

def merge_attention(out_a, lse_a, out_b, lse_b):
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    {weights}
    total = wa + wb
    out = {out}
    lse = {lse}
    return out, lse
'''
_MERGE_RIGHT = dict(weights="wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)",
                    out="(out_a * wa[..., None] + out_b * wb[..., None])"
                        " / torch.where(total > 0, total, 1.0)[..., None]",
                    lse="top + torch.log(total)")


def _merge(**changes):
    return notebook_function(_MERGE.format(**{**_MERGE_RIGHT, **changes}))


def test_merge_reference_written_in_a_cell_passes():
    result = exercises.check_merge_attention(_merge())
    assert result.passed, result.message


@pytest.mark.parametrize("answer, fragments", [
    (dict(out="(out_a + out_b) / 2"), ["case 'no mask'", "the two outputs were averaged", "must weigh more"]),
    (dict(out="(out_a * lse_a[..., None] + out_b * lse_b[..., None]) / (lse_a + lse_b)[..., None]"),
     ["the outputs were weighted by their lse", "the LOG of a block's denominator"]),
    (dict(out="out_a * wa[..., None] + out_b * wb[..., None]"), ["the weights do not add up to 1"]),
    (dict(weights="wa, wb = torch.exp(lse_a), torch.exp(lse_b)", lse="torch.log(total)",
          out="(out_a * wa[..., None] + out_b * wb[..., None]) / total[..., None]"),
     ["case 'scores near 150: exp overflows float32'", "exp(lse) overflowed", "shift both lse by the larger"]),
    (dict(lse="torch.maximum(lse_a, lse_b)"), ["case 'no mask'", "lse is the larger of the two lse",
                                               "denominators exp(lse_a) and exp(lse_b) add up"]),
], ids=["average", "lse-weights", "unnormalised", "no-shift", "lse-max"])
def test_merge_names_each_wrong_answer(answer, fragments):
    result = exercises.check_merge_attention(_merge(**answer))
    assert not result.passed and result.message.startswith("❌ merge_attention")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_merge_that_calls_the_library_is_refused_before_any_rank_starts():
    fn = notebook_function("""
        from parallel_lib.context_parallel import merge_partials
        def merge_attention(out_a, lse_a, out_b, lse_b):
            return merge_partials(out_a, lse_a, out_b, lse_b)
    """)
    result = exercises.check_merge_attention(fn)
    assert not result.passed and "calls parallel_lib" in result.message, result.message


# ----------------------------------------------------------------------------- the zig-zag positions

_ZIGZAG = '''
def zigzag_positions(seq_len, cp, rank):
    c = seq_len // {chunks}
    first, second = {chunks_of_rank}
    return {result}
'''
_ZIGZAG_RIGHT = dict(chunks="(2 * cp)", chunks_of_rank="rank, 2 * cp - 1 - rank",
                     result="list(range(first * c, (first + 1) * c)) + list(range(second * c, (second + 1) * c))")


def _zigzag(**changes):
    return notebook_function(_ZIGZAG.format(**{**_ZIGZAG_RIGHT, **changes}))


def test_zigzag_reference_written_in_a_cell_passes_and_reports_equal_work():
    result = exercises.check_zigzag_positions(_zigzag())
    assert result.passed, result.message
    assert "every rank of cp = 4 on 64 tokens has 520 causal score entries" in result.message  # 64·65/2 / 4


@pytest.mark.parametrize("answer, fragments", [
    (dict(chunks_of_rank="2 * rank, 2 * rank + 1"), ["case zigzag_positions(8, 2, 0)", "contiguous split's positions",
                                                     "2·cp − 1 times"]),
    (dict(chunks_of_rank="rank, 2 * cp - rank"), ["the second chunk is one too far", "chunk 2·cp − 1 − i"]),
    (dict(chunks_of_rank="rank, cp + rank"), ["counted from the END"]),
    (dict(result="list(range(second * c, (second + 1) * c)) + list(range(first * c, (first + 1) * c))"),
     ["case zigzag_positions(8, 2, 0)", "not in increasing order"]),
    (dict(chunks="cp"), ["two chunks of seq_len / (2·cp)"]),
    (dict(result="range(first * c, (first + 1) * c)"), ["expected [0, 1, 6, 7], got [0, 1]"]),
], ids=["contiguous", "mirror-off-by-one", "same-offset", "unsorted", "chunk-too-long", "one-chunk"])
def test_zigzag_names_each_wrong_answer(answer, fragments):
    result = exercises.check_zigzag_positions(_zigzag(**answer))
    assert not result.passed and result.message.startswith("❌ zigzag_positions")
    for fragment in fragments:
        assert fragment in result.message, result.message


# ----------------------------------------------------------------------------- the busiest rank's share, measured

def test_the_share_is_measured_on_ranks_from_the_ring_steps_work():
    """4 gloo ranks run ring attention and count their causal entries: rank 3 holds positions 192..255."""
    from parallel_lib.exercises.ch11 import measured_shares
    shares = measured_shares()
    contiguous, zigzag = shares["contiguous"], shares["zigzag"]
    assert contiguous == sorted(contiguous) and sum(contiguous) == pytest.approx(1.0)
    assert contiguous[-1] == pytest.approx(sum(range(193, 257)) / (256 * 257 / 2), rel=1e-12)  # positions 192..255
    assert contiguous[-1] / contiguous[0] == pytest.approx(7, rel=0.1)
    assert zigzag == [pytest.approx(0.25, rel=1e-12)] * 4


@pytest.mark.parametrize("answer, fragment", [
    (7 / 16, None), ((2 * 4 - 1) / 4**2, None), (14368 / 32896, None),
    (0.25, "1/cp is every rank's share under the zig-zag split"),
    (7, "the busiest rank's work over the idlest's"),
    (43.75, "a fraction between 0 and 1, not per cent"),
    (0.3, "the last rank's queries are the latest positions"),
    (1 / 16, "that is rank 0's share, the idlest"),
    (0.5, "you let each of the last rank's s/cp queries see all s keys"),
    (64 * 256 / 32896, "under the causal mask the query at position p sees p + 1"),
    (0.6, "add p + 1 over the last rank's"),
    (None, "BUSIEST_SHARE is not answered yet"),
    ("7/16", "BUSIEST_SHARE = '7/16', but the answer must be a number"),
])
def test_busiest_share_answers(answer, fragment):
    result = exercises.check_busiest_share(answer)
    if fragment is None:
        assert result.passed and "measured on 4 gloo ranks, 0.4368 for rank 3 of 4" in result.message, result.message
        assert "zig-zag's ranks: 0.2500, 0.2500, 0.2500, 0.2500" in result.message, result.message
    else:
        assert not result.passed and fragment in result.message, result.message


# ----------------------------------------------------------------------------- graded labs

def test_hidden_solutions_leave_the_chapter_11_checkers_running(monkeypatch):
    """A graded lab: solutions.py gone, chapter 11 imported afresh; no answer is importable, the checkers check."""
    import importlib
    import sys

    import parallel_lib.exercises as package
    from parallel_lib.exercises._core import HIDDEN
    modules = ["ch11", "ch11_merge"]
    measured = sys.modules["parallel_lib.exercises.ch11"].measured_shares   # the ranks' counts, measured once
    monkeypatch.setitem(sys.modules, "parallel_lib.exercises.solutions", None)  # import now fails, as when deleted
    for name in modules:
        monkeypatch.delitem(sys.modules, f"parallel_lib.exercises.{name}")
        monkeypatch.delattr(package, name, raising=False)
    with pytest.raises(ImportError):
        from parallel_lib.exercises.solutions import merge_attention  # noqa: F401
    fresh = importlib.import_module("parallel_lib.exercises.ch11")
    assert all(item.solution is HIDDEN for item in fresh.EXERCISES)
    assert fresh.check_zigzag_positions(_zigzag()).passed
    assert "one too far" in fresh.check_zigzag_positions(_zigzag(chunks_of_rank="rank, 2 * cp - rank")).message
    monkeypatch.setattr(fresh, "measured_shares", measured)
    assert fresh.check_busiest_share(0.4375).passed
    assert "not written yet" in fresh.check_merge_attention(notebook_function(
        "def merge_attention(out_a, lse_a, out_b, lse_b):\n    ...\n")).message


def test_grade_notebook_scores_the_stubs_zero_and_the_filled_answers(tmp_path):
    """The notebook's own exercise cells: the stubs score 0; filled with the references (the merge left as its
    stub, whose ranks the tests above run), the other two pass."""
    import glob
    import inspect
    import textwrap

    import nbformat

    from parallel_lib.exercises import grade_notebook
    path = glob.glob("notebooks/11_*.ipynb")[0]
    assert [r.passed for r in grade_notebook(path)] == [False] * len(EXERCISES["11"])
    nb = nbformat.read(path, as_version=4)
    for item in EXERCISES["11"][1:]:
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source == item.stub.rstrip("\n"))
        cell.source = (textwrap.dedent(inspect.getsource(item.solution)) if callable(item.solution)
                       else f"{item.answer_name} = {item.solution!r}")
    filled = tmp_path / "11_filled.ipynb"
    nbformat.write(nb, filled)
    assert [r.passed for r in grade_notebook(filled)] == [False, True, True]
