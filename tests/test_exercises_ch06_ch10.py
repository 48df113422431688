"""Chapters 06 and 10's coding exercises: each checker passes the reference and names the typical wrong answers.

The two gloo checkers of chapter 06 check every answer of a test in ONE launch (``check_zero2_steps``,
``check_clip_grad_norm_sharded_many``), in module-scoped fixtures: the reference answer from
``solutions.py``, the same written in a notebook cell, and each wrong answer, written as a student writes
it (``notebook_function`` compiles it in ``__main__`` with its source findable, as IPython does).
"""

import pytest

from parallel_lib import exercises
from parallel_lib.exercises import EXERCISES
from parallel_lib.exercises.ch06_clip import check_clip_grad_norm_sharded_many
from parallel_lib.exercises.ch06_zero2 import check_zero2_steps
from test_exercises import notebook_function  # the same module pytest collects: one counter of cell names

# ----------------------------------------------------------------------------- chapter 06: a ZeRO-2 step

_ZERO2 = '''
import torch
import torch.distributed as dist

def zero2_rank(flat_params, make_optimizer):
    n, rank = dist.get_world_size(), dist.get_rank()
    size = flat_params.numel() // n
    shard = flat_params[rank * size:(rank + 1) * size].clone()
    optimizer = make_optimizer([{updated}])

    def step(flat_grad):
        {body}
    return step
'''
_REDUCE_SCATTER = "grad = torch.empty(size)\n        dist.reduce_scatter_tensor(grad, flat_grad)"
_ALL_REDUCE = "dist.all_reduce(flat_grad)\n        grad = flat_grad[rank * size:(rank + 1) * size]"
_UPDATE_THEN_GATHER = "optimizer.step()\n        dist.all_gather_into_tensor(flat_params, shard)"
_GATHER_THEN_UPDATE = "dist.all_gather_into_tensor(flat_params, shard)\n        optimizer.step()"
_STEP = """grad = torch.empty(size)
        dist.reduce_scatter_tensor(grad, flat_grad)
        shard.grad = grad / n
        optimizer.step()
        dist.all_gather_into_tensor(flat_params, shard)"""
ZERO2_WRONG = {
    "all-reduce": (dict(body=_STEP.replace(_REDUCE_SCATTER, _ALL_REDUCE)),
                   ["all-reduced the whole gradient", "ZeRO-1", "which half of the ring all-reduce"]),
    "not-divided": (dict(body=_STEP.replace("grad / n", "grad")),
                    ["saw 2 times the mean gradient", "not divided by the world size"]),
    "full-parameters": (dict(updated="flat_params", body="""dist.all_reduce(flat_grad)
        flat_params.grad = flat_grad / n
        optimizer.step()"""), ["case setting up", "the full parameters are updated instead of this rank's shard"]),
    "gathered-first": (dict(body=_STEP.replace(_UPDATE_THEN_GATHER, _GATHER_THEN_UPDATE)),
                       ["still holds the old parameters", "gathered before the update"]),
    "gradients-gathered": (dict(body="""every = [torch.empty_like(flat_grad) for _ in range(n)]
        dist.all_gather(every, flat_grad)
        shard.grad = (sum(every) / n)[rank * size:(rank + 1) * size]
        optimizer.step()
        dist.all_gather_into_tensor(flat_params, shard)"""), ["bytes in one step", "send 336"]),
    "not-reduced": (dict(body="""shard.grad = flat_grad[rank * size:(rank + 1) * size].clone()
        optimizer.step()
        dist.all_gather_into_tensor(flat_params, shard)"""), ["only its own micro-batch's gradient"]),
}


def _zero2(**changes):
    return notebook_function(_ZERO2.format(**{"updated": "shard", "body": _STEP, **changes}))


@pytest.fixture(scope="module")
def zero2_results():
    """One launch of 2 gloo ranks: the reference from solutions.py, the same in a cell, then every wrong answer."""
    from parallel_lib.exercises.solutions import zero2_rank
    answers = [zero2_rank, _zero2()] + [_zero2(**changes) for changes, _ in ZERO2_WRONG.values()]
    return dict(zip(["solutions.py", "cell", *ZERO2_WRONG], check_zero2_steps(answers)))


@pytest.mark.parametrize("answer", ["solutions.py", "cell"])
def test_zero2_step_reference_passes(zero2_results, answer):
    result = zero2_results[answer]
    assert result.passed and "equal one process" in result.message and "42 of 84 elements" in result.message, result


@pytest.mark.parametrize("answer", list(ZERO2_WRONG))
def test_zero2_step_names_each_wrong_answer(zero2_results, answer):
    result = zero2_results[answer]
    assert not result.passed and result.message.startswith("❌ zero2_step")
    for fragment in ZERO2_WRONG[answer][1]:
        assert fragment in result.message, result.message


# ----------------------------------------------------------------------------- chapter 06: clipping a sharded gradient

_CLIP = '''
import torch
import torch.distributed as dist

def clip_grad_norm_sharded(shards, max_norm):
    squares = sum(s.double().pow(2).sum() for s in shards)
    {reduce}
    norm = {norm}
    scale = {scale}
    for s in shards:
        {apply}
    return {result}
'''
_RIGHT = dict(reduce="dist.all_reduce(squares)", norm="squares.sqrt()",
              scale="min(1.0, max_norm / (float(norm) + 1e-6))", apply="s.mul_(scale)", result="norm")
CLIP_WRONG = {
    "own-norm": (dict(reduce="pass"), ["each shard was clipped by its own norm",
                                       "squared norms were not summed across the ranks",
                                       "no shard alone exceeds max_norm, the whole gradient does"]),
    "sqrt-first": (dict(reduce="squares = squares.sqrt(); dist.all_reduce(squares)", norm="squares"),
                   ["the square root was taken before the all-reduce"]),
    "squares-averaged": (dict(reduce="dist.all_reduce(squares); squares /= dist.get_world_size()"),
                         ["the squares were averaged over the ranks"]),
    "max": (dict(reduce="dist.all_reduce(squares, op=dist.ReduceOp.MAX)"), ["the largest shard's norm"]),
    "no-root": (dict(norm="squares"), ["the square root is missing"]),
    "scaled-up": (dict(scale="max_norm / (float(norm) + 1e-6)"), ["scaled up although its norm is below max_norm"]),
    "not-in-place": (dict(apply="s = s * scale"), ["the gradient was not changed"]),
    "norm-after": (dict(result="min(float(norm), max_norm)"), ["case step 1", "the norm returned is the norm after "
                                                                              "clipping"]),
}


def _clip(**changes):
    return notebook_function(_CLIP.format(**{**_RIGHT, **changes}))


@pytest.fixture(scope="module")
def clip_results():
    """One launch of 2 gloo ranks: the engine's own clipping, the references, then every wrong answer."""
    from parallel_lib.exercises.solutions import clip_grad_norm_sharded
    answers = [clip_grad_norm_sharded, _clip()] + [_clip(**changes) for changes, _ in CLIP_WRONG.values()]
    return dict(zip(["solutions.py", "cell", *CLIP_WRONG], check_clip_grad_norm_sharded_many(answers)))


@pytest.mark.parametrize("answer", ["solutions.py", "cell"])
def test_clip_grad_norm_sharded_reference_passes(clip_results, answer):
    result = clip_results[answer]
    assert result.passed and "clipped as ZeroEngine.clip_grad_norm_ clips" in result.message, result


@pytest.mark.parametrize("answer", list(CLIP_WRONG))
def test_clip_grad_norm_sharded_names_each_wrong_answer(clip_results, answer):
    result = clip_results[answer]
    assert not result.passed and result.message.startswith("❌ clip_grad_norm_sharded")
    for fragment in CLIP_WRONG[answer][1]:
        assert fragment in result.message, result.message


def test_the_gloo_checkers_refuse_the_library_and_report_stubs_without_starting_ranks():
    library = notebook_function("""
        from parallel_lib.sharding.zero import ZeroEngine
        def zero2_rank(flat_params, make_optimizer):
            return ZeroEngine
    """)
    result = exercises.check_zero2_step(library)
    assert not result.passed and "calls parallel_lib" in result.message, result.message
    for item in EXERCISES["06"]:
        with pytest.raises(TypeError, match="pass the function itself"):
            item.check(3)


# ----------------------------------------------------------------------------- chapter 10: a layout and its reason

_BEST = dict(dp=8, tp=2, pp=1, zero=1)          # the fastest layout of the job
_ZERO2_NEIGHBOUR = dict(dp=8, tp=2, pp=1, zero=2)  # 20.7 GiB, 3.26 s: ZeRO-2 reduce-scatters every micro-batch
_PIPE = dict(dp=4, tp=2, pp=2, zero=1)           # within 10 %; its neighbour DP2×TP2×PP4 keeps 4 micro-batches


def _reason(layout=_BEST, neighbour=_ZERO2_NEIGHBOUR, gib=20.73, seconds=3.262):
    return dict(layout=layout, neighbour=neighbour, neighbour_gib=gib, neighbour_seconds=seconds)


@pytest.mark.parametrize("answer, fragment", [
    (_reason(), None),
    (_reason(_PIPE, dict(dp=2, tp=2, pp=4, zero=1), 18.6, 3.49), None),
    (_reason(neighbour=dict(dp=16, tp=1, pp=1, zero=0), gib=121.1, seconds=None), "more than one change away"),
    (_reason(neighbour=dict(dp=16, tp=1, pp=1, zero=1), gib=47.9, seconds=3.17), None),  # tp halved, dp doubled
    (_reason(gib=22.26), "memory in GB (10^9 bytes)"),
    (_reason(gib=12.2), "model state alone"),
    (_reason(gib=26.4), "your own layout's memory"),
    (_reason(_PIPE, dict(dp=2, tp=2, pp=4, zero=1), 12.2, 3.49), "one micro-batch's activations"),
    (_reason(seconds=2.693), "compute alone"),
    (_reason(seconds=2.979), "your own layout's step time"),
    (_reason(seconds=None), "predict its step time"),
    (_reason(neighbour=dict(dp=8, tp=2, pp=1, zero=0), gib=60.7, seconds=2.979), "is not slower"),
    (_reason(neighbour=_BEST), "the neighbour is your layout itself"),
    (_reason(layout=dict(dp=16, tp=1, pp=1, zero=0)), "does not fit"),
    (_reason(layout=dict(dp=2, tp=1, pp=8, zero=1)), "pipeline bubble"),
    (_reason(layout=dict(dp=8, tp=2, pp=2, zero=1)), "the budget is 16 GPUs"),
    (_BEST, "a plan_layouts(...).best copied answers the layout only"),
    (None, "not answered yet"),
])
def test_layout_reason_answers(answer, fragment):
    result = exercises.check_layout_reason(answer)
    assert result.passed == (fragment is None), result.message
    assert fragment is None or fragment in result.message, result.message


# ----------------------------------------------------------------------------- chapter 10: mesh coordinates

_COORDS = '''
def mesh_coords(rank, dp, tp, pp, order):
    sizes = {{"dp": dp, "tp": tp, "pp": pp}}
    coords, stride = {{}}, 1
    for axis in {axes}:
        coords[axis] = {coordinate}
        stride *= sizes[axis]
    return coords
'''


@pytest.mark.parametrize("axes, coordinate, fragments", [
    ('order.split("-")', "rank // stride % sizes[axis]", None),
    ('order.split("-")[::-1]', "rank // stride % sizes[axis]", ["mesh_coords(1, 2, 2, 2, 'tp-pp-dp')",
                                                                "the order was read slowest-first"]),
    ('["tp", "pp", "dp"]', "rank // stride % sizes[axis]", ["'tp-dp-pp'", "one order (tp, then pp, then dp)"]),
    ('order.split("-")', "rank // sizes[axis] % sizes[axis]", ["own size was taken as its stride"]),
    ('order.split("-")', "rank // stride", ["as large as its axis or larger"]),
], ids=["right", "slowest-first", "one-order", "own-stride", "no-remainder"])
def test_mesh_coords_names_each_wrong_answer(axes, coordinate, fragments):
    result = exercises.check_mesh_coords(notebook_function(_COORDS.format(axes=axes, coordinate=coordinate)))
    assert result.passed == (fragments is None), result.message
    for fragment in fragments or []:
        assert fragment in result.message, result.message


# ----------------------------------------------------------------------------- the registry, graded labs

def test_chapters_06_and_10_have_two_coding_exercises_each_and_answers_in_solutions():
    from parallel_lib.exercises import solutions
    coding = {"06": {"zero2_step", "clip_grad_norm_sharded"}, "10": {"layout_reason", "mesh_coords"}}
    for chapter, names in coding.items():
        items = {item.name: item for item in EXERCISES[chapter]}
        assert names <= set(items)
        for item in items.values():
            assert any(getattr(solutions, name) is item.solution for name in solutions.__all__), item.name


def test_hidden_solutions_leave_the_chapter_06_and_10_checkers_running(monkeypatch):
    """A graded lab: solutions.py gone, the chapters imported afresh; no answer is importable, the checkers check."""
    import importlib
    import sys

    import parallel_lib.exercises as package
    from parallel_lib.exercises._core import HIDDEN
    modules = ["ch06", "ch06_zero2", "ch06_clip", "ch10", "ch10_reason", "ch10_mesh"]
    monkeypatch.setitem(sys.modules, "parallel_lib.exercises.solutions", None)  # import now fails, as when deleted
    for name in modules:  # fresh copies; monkeypatch puts the originals back afterwards
        monkeypatch.delitem(sys.modules, f"parallel_lib.exercises.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    with pytest.raises(ImportError):
        from parallel_lib.exercises.solutions import zero2_rank  # noqa: F401
    fresh = {name: importlib.import_module(f"parallel_lib.exercises.{name}") for name in modules}
    for chapter in ("ch06", "ch10"):
        assert all(item.solution is HIDDEN for item in fresh[chapter].EXERCISES)
    assert fresh["ch10"].check_layout_reason(_reason()).passed
    right = notebook_function(_COORDS.format(axes='order.split("-")', coordinate="rank // stride % sizes[axis]"))
    assert fresh["ch10"].check_mesh_coords(right).passed
    for item in fresh["ch06"].EXERCISES:  # the stubs: reported as not written, before any rank starts
        stub = notebook_function(item.stub)
        assert "not written yet" in item.check(stub).message


@pytest.mark.parametrize("chapter", ["06", "10"])
def test_the_notebook_ends_with_the_grade_cell_which_grades_the_stubs_fast(chapter):
    import glob
    import time

    import nbformat

    from parallel_lib.exercises import grade_notebook
    (path,) = glob.glob(f"notebooks/{chapter}_*.ipynb")
    assert nbformat.read(path, as_version=4).cells[-1].source == (
        f"from parallel_lib.exercises import grade\n\ngrade({chapter!r}, globals())")
    start = time.perf_counter()
    grades = grade_notebook(path)
    assert [r.passed for r in grades] == [False] * len(EXERCISES[chapter])
    assert time.perf_counter() - start < 5  # the stubs never start ranks


def test_grade_notebook_scores_notebook_10_filled_with_the_answers(tmp_path):
    import glob
    import inspect
    import textwrap

    import nbformat

    from parallel_lib.exercises import grade_notebook
    (path,) = glob.glob("notebooks/10_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    for item in EXERCISES["10"]:  # the student fills each stub cell with the reference answer
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source == item.stub.rstrip("\n"))
        cell.source = (textwrap.dedent(inspect.getsource(item.solution)) if callable(item.solution)
                       else f"{item.answer_name} = {item.solution!r}")
    filled = tmp_path / "10_filled.ipynb"
    nbformat.write(nb, filled)
    grades = grade_notebook(filled)
    assert all(r.passed for r in grades) and repr(grades).endswith("score: 4 / 4"), grades
