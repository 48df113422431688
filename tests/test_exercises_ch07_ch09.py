"""Chapters 07 and 09's coding exercises: each checker passes the reference and names the typical wrong answers.

Wrong answers are written as a student writes them in a notebook cell (``notebook_function`` compiles
them in ``__main__`` with their source findable, as IPython does), so the gloo checkers ship them to
their ranks exactly as they would from a kernel. Each test asserts the mistake's name in the message.
"""

import pytest

from parallel_lib import exercises
from parallel_lib.exercises import EXERCISES
from test_exercises import notebook_function  # the same module pytest collects: one counter of cell names

# ----------------------------------------------------------------------------- chapter 07: f and g

_F_AND_G = '''
import torch
import torch.distributed as dist

def tp_operators():
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            {f_forward}
        @staticmethod
        def backward(ctx, grad):
            {f_backward}

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            {g_forward}
        @staticmethod
        def backward(ctx, grad):
            {g_backward}

    return F.apply, G.apply
'''
IDENTITY, SUM = "return x", "x = x.clone(); dist.all_reduce(x); return x"
IDENTITY_BACK, SUM_BACK = "return grad", "grad = grad.clone(); dist.all_reduce(grad); return grad"
MEAN_BACK = "grad = grad.clone(); dist.all_reduce(grad); return grad / dist.get_world_size()"


def _operators(f_forward=IDENTITY, f_backward=SUM_BACK, g_forward=SUM, g_backward=IDENTITY_BACK):
    return notebook_function(_F_AND_G.format(f_forward=f_forward, f_backward=f_backward, g_forward=g_forward,
                                             g_backward=g_backward))


@pytest.mark.parametrize("answer, fragments", [
    (dict(f_forward=SUM, f_backward=IDENTITY_BACK, g_forward=IDENTITY, g_backward=SUM_BACK),
     ["f and g are swapped", "which of the two needs summing on the way forward"]),
    (dict(f_backward=IDENTITY_BACK), ["f's backward is not all-reduced", "each slice sends back its own part"]),
    (dict(g_backward=SUM_BACK), ["g's backward all-reduces", "t times too large"]),
    (dict(g_forward=IDENTITY), ["g's forward returns the partial output unchanged"]),
    (dict(f_backward=MEAN_BACK), ["f's backward averages over the ranks"]),
], ids=["swapped", "f-backward-local", "g-backward-summed", "g-forward-local", "f-backward-mean"])
def test_tp_operators_names_each_wrong_answer(answer, fragments):
    result = exercises.check_tp_operators(_operators(**answer))
    assert not result.passed and result.message.startswith("❌ tp_operators")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_tp_operators_reference_written_in_a_cell_passes():
    result = exercises.check_tp_operators(_operators())
    assert result.passed, result.message


def test_tp_operators_that_call_the_library_are_refused_before_any_rank_starts():
    fn = notebook_function("""
        from parallel_lib.tensor_parallel import regions
        def tp_operators():
            return regions.copy_to_tensor_parallel_region, regions.reduce_from_tensor_parallel_region
    """)
    result = exercises.check_tp_operators(fn)
    assert not result.passed and "calls parallel_lib" in result.message, result.message


def test_tp_operators_without_autograd_is_named():
    fn = notebook_function("""
        import torch.distributed as dist
        def tp_operators():
            def f(x):
                return x.detach()
            def g(x):
                y = x.detach().clone()
                dist.all_reduce(y)
                return y
            return f, g
    """)
    result = exercises.check_tp_operators(fn)
    assert not result.passed and "case 'f alone'" in result.message and "torch.autograd.Function" in result.message


def test_tp_operators_with_classes_outside_the_function_say_what_travels_to_the_ranks():
    fn = notebook_function("""
        import torch
        import torch.distributed as dist

        class Copy(torch.autograd.Function):   # right, but a notebook class cannot travel to the ranks
            @staticmethod
            def forward(ctx, x):
                return x
            @staticmethod
            def backward(ctx, grad):
                grad = grad.clone()
                dist.all_reduce(grad)
                return grad

        def tp_operators():
            return Copy.apply, Copy.apply
    """)
    result = exercises.check_tp_operators(fn)
    assert not result.passed and "NameError" in result.message
    assert "define everything inside it" in result.message, result.message


# ----------------------------------------------------------------------------- chapter 07: vocabulary-parallel loss

_LOSS = '''
import torch
import torch.distributed as dist

def vocab_cross_entropy(logits_mine, target, vocab_start):
    z = logits_mine.float()
    counted = target != -100
    top = z.max(dim=-1).values
    {max_line}
    shifted = z - top[:, None]
    total = shifted.exp().sum(dim=-1)
    {sum_line}
    n = z.shape[-1]
    mine = {mine}
    index = (target - vocab_start).clamp(0, n - 1)
    picked = shifted.gather(-1, index[:, None])[:, 0] * mine
    dist.all_reduce(picked)
    return {result}
'''
_RIGHT = dict(max_line="dist.all_reduce(top, op=dist.ReduceOp.MAX)", sum_line="dist.all_reduce(total)",
              mine="(target >= vocab_start) & (target < vocab_start + n)", result="(total.log() - picked) * counted")


def _loss(**changes):
    return notebook_function(_LOSS.format(**{**_RIGHT, **changes}))


_NO_MAX = notebook_function('''
import torch
import torch.distributed as dist

def vocab_cross_entropy(logits_mine, target, vocab_start):
    total = logits_mine.exp().sum(-1)
    dist.all_reduce(total)
    n = logits_mine.shape[-1]
    mine = (target >= vocab_start) & (target < vocab_start + n)
    picked = logits_mine.gather(-1, (target - vocab_start).clamp(0, n - 1)[:, None])[:, 0] * mine
    dist.all_reduce(picked)
    return (total.log() - picked) * (target != -100)
''')


@pytest.mark.parametrize("answer, fragments", [
    (_NO_MAX, ["case 'float32 logits near 1000'", "exp overflowed, the logits were not shifted by their maximum"]),
    (dict(max_line="dist.all_reduce(top)"), ["the ranks' maxima were all-reduced with SUM",
                                             "which reduction of the ranks' own maxima"]),
    (dict(max_line="pass"), ["case 'float32 logits'", "each rank shifted by its own maximum"]),
    (dict(mine="torch.ones_like(target, dtype=torch.bool)"), ["every rank contributed a target logit"]),
    (dict(result="total.log() - picked"), ["case 'float32 logits, 2 targets -100'",
                                           "tokens with target -100 got a loss"]),
    (dict(sum_line="pass"), ["the sum of exponentials covers this rank's slice only"]),
    (dict(result="((total.log() - picked) * counted).mean()"), ["returned shape ()", "reduction='none'"]),
], ids=["no-max", "max-summed", "own-max", "target-everywhere", "ignore-counted", "sum-local", "mean"])
def test_vocab_cross_entropy_names_each_wrong_answer(answer, fragments):
    fn = answer if callable(answer) else _loss(**answer)
    result = exercises.check_vocab_cross_entropy(fn)
    assert not result.passed and result.message.startswith("❌ vocab_cross_entropy")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_vocab_cross_entropy_reference_written_in_a_cell_passes():
    result = exercises.check_vocab_cross_entropy(_loss())
    assert result.passed, result.message


def test_vocab_cross_entropy_in_the_logits_dtype_passes():
    """Shifted by the maximum, the loss may stay in bfloat16/float16: the tolerance follows the dtype."""
    result = exercises.check_vocab_cross_entropy(notebook_function(_LOSS.format(**{**_RIGHT}).replace(
        "z = logits_mine.float()", "z = logits_mine")))
    assert result.passed, result.message


def test_vocab_cross_entropy_target_index_outside_the_slice_is_named():
    fn = notebook_function(_LOSS.format(**_RIGHT).replace(".clamp(0, n - 1)", ""))
    result = exercises.check_vocab_cross_entropy(fn)
    assert not result.passed and "case 'float32 logits'" in result.message
    assert "is not a column of it" in result.message, result.message


# ----------------------------------------------------------------------------- chapter 09: a GQA decode step

_DECODE = '''
import math
import torch

def gqa_decode_step(x, wq, wk, wv, wo, k_cache, v_cache, length):
    batch, n_kv, _, d = k_cache.shape
    n_heads = wq.shape[0] // d
    q = (x @ wq.T).view(batch, n_heads, 1, d)
    {write_k}
    v_cache[:, :, {slot}] = (x @ wv.T).view(batch, n_kv, d)
    k = k_cache[:, :, :{upto}].{expand}(n_heads // n_kv, dim=1)
    v = v_cache[:, :, :{upto}].{expand}(n_heads // n_kv, dim=1)
    scores = q @ k.transpose(-1, -2){scale}
    return (scores.softmax(-1) @ v).reshape(batch, n_heads * d) @ wo.T
'''
_DECODE_RIGHT = dict(write_k="k_cache[:, :, length] = (x @ wk.T).view(batch, n_kv, d)", slot="length",
                     upto="length + 1", expand="repeat_interleave", scale=" / math.sqrt(d)")


def _decode(**changes):
    source = _DECODE.format(**{**_DECODE_RIGHT, **changes})
    return notebook_function(source.replace(".repeat(n_heads // n_kv, dim=1)", ".repeat(1, n_heads // n_kv, 1, 1)"))


_DECODE_BY_CAT = notebook_function('''
import math
import torch

def gqa_decode_step(x, wq, wk, wv, wo, k_cache, v_cache, length):   # right output, cache never written
    batch, n_kv, _, d = k_cache.shape
    n_heads = wq.shape[0] // d
    q = (x @ wq.T).view(batch, n_heads, 1, d)
    k = torch.cat([k_cache[:, :, :length], (x @ wk.T).view(batch, n_kv, 1, d)], 2).repeat_interleave(n_heads // n_kv, 1)
    v = torch.cat([v_cache[:, :, :length], (x @ wv.T).view(batch, n_kv, 1, d)], 2).repeat_interleave(n_heads // n_kv, 1)
    return ((q @ k.transpose(-1, -2) / math.sqrt(d)).softmax(-1) @ v).reshape(batch, n_heads * d) @ wo.T
''')


@pytest.mark.parametrize("answer, fragments", [
    (dict(expand="repeat"), ["case '4 query heads, 2 KV heads, 5 tokens cached'", "paired with the wrong KV heads",
                             "which KV head do query heads 0 and 1"]),
    (dict(scale=""), ["the scores were not scaled"]),
    (dict(upto="k_cache.shape[2]"), ["attention read the unused slots"]),
    (_DECODE_BY_CAT, ["k_cache is unchanged: the new token's key and value were not stored"]),
    (dict(write_k="k_cache[:, :, length - 1] = (x @ wk.T).view(batch, n_kv, d)"),
     ["k_cache: the new token went into slot length-1, over the last cached token"]),
    (dict(upto="length"), ["the new token does not attend to itself"]),
], ids=["tiled", "unscaled", "garbage-slots", "not-written", "off-by-one", "no-self"])
def test_gqa_decode_step_names_each_wrong_answer(answer, fragments):
    result = exercises.check_gqa_decode_step(answer if callable(answer) else _decode(**answer))
    assert not result.passed and result.message.startswith("❌ gqa_decode_step")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_gqa_decode_step_reference_written_in_a_cell_passes():
    result = exercises.check_gqa_decode_step(_decode())
    assert result.passed, result.message


def test_gqa_decode_checker_builds_a_grouped_hugging_face_attention():
    from parallel_lib.exercises.ch09_decode import _GQA_CASES, _llama_attention
    grouped = [c for c in _GQA_CASES if c[2] not in (1, c[1])]
    assert len(grouped) >= 2
    attention = _llama_attention(*grouped[0][:4], seed=0)
    assert attention.num_key_value_groups == grouped[0][1] // grouped[0][2] > 1
    assert attention.config._attn_implementation == "eager"


# ----------------------------------------------------------------------------- chapter 09: the cache's write and read

_STEP = '''
import torch

def cache_step(k_cache, v_cache, k_new, v_new, lengths):
    rows = torch.arange(k_cache.shape[0])
    slots = {slots}
    k_cache[rows, :, slots] = k_new[:, :, 0]
    v_cache[rows, :, slots] = v_new[:, :, 0]
    upto = {upto}
    mask = {mask}
    return k_cache[:, :, :upto], v_cache[:, :, :upto], mask
'''
_STEP_RIGHT = dict(slots="lengths", upto="int(lengths.max()) + 1",
                   mask="torch.arange(upto)[None, :] <= lengths[:, None]")


def _step(**changes):
    return notebook_function(_STEP.format(**{**_STEP_RIGHT, **changes}))


@pytest.mark.parametrize("answer, fragments", [
    (dict(slots="lengths - 1"), ["went into slot lengths[b]-1, over its last token"]),
    (dict(slots="lengths.max().expand_as(lengths)"), ["every row's new key went into the same slot"]),
    (dict(mask="torch.ones(len(lengths), upto, dtype=torch.bool)"), ["a shorter row may attend slots it never filled"]),
    (dict(mask="torch.arange(upto)[None, :] < lengths[:, None]"), ["the new token may not attend to itself"]),
    (dict(upto="int(lengths.max())"), ["k has shape", "the longest row's new token sits in slot max(lengths)"]),
    (dict(slots="lengths.clone(); k_cache = k_cache.clone(); v_cache = v_cache.clone()"),
     ["k_cache is unchanged: the new keys were not stored"]),
], ids=["off-by-one", "same-slot", "mask-all", "mask-no-self", "upto-short", "not-in-place"])
def test_cache_step_names_each_wrong_answer(answer, fragments):
    result = exercises.check_cache_step(_step(**answer))
    assert not result.passed and result.message.startswith("❌ cache_step")
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_cache_step_reference_written_in_a_cell_passes():
    result = exercises.check_cache_step(_step())
    assert result.passed, result.message


# ----------------------------------------------------------------------------- the registry, graded labs

def test_chapters_07_and_09_have_two_coding_exercises_each_whose_answers_live_in_solutions():
    from parallel_lib.exercises import solutions
    coding = {"07": {"tp_operators", "vocab_cross_entropy"}, "09": {"gqa_decode_step", "cache_step"}}
    for chapter, names in coding.items():
        items = {item.name: item for item in EXERCISES[chapter]}
        assert names <= set(items)
        for item in items.values():
            assert any(getattr(solutions, name) is item.solution for name in solutions.__all__), item.name
    assert {item.name for item in EXERCISES["07"]}.isdisjoint({"missing_operator", "tp_block_bytes"})


def test_hidden_solutions_leave_the_chapter_07_and_09_checkers_running(monkeypatch):
    """A graded lab: solutions.py gone, the chapters imported afresh; no answer is importable, every checker checks."""
    import importlib
    import sys

    import parallel_lib.exercises as package
    from parallel_lib.exercises._core import HIDDEN
    modules = ["ch07", "ch07_operators", "ch07_vocab_loss", "ch09", "ch09_decode"]
    monkeypatch.setitem(sys.modules, "parallel_lib.exercises.solutions", None)  # import now fails, as when deleted
    for name in modules:  # fresh copies; monkeypatch puts the originals back afterwards
        monkeypatch.delitem(sys.modules, f"parallel_lib.exercises.{name}")
        monkeypatch.delattr(package, name, raising=False)
    with pytest.raises(ImportError):
        from parallel_lib.exercises.solutions import tp_operators  # noqa: F401
    fresh = {name: importlib.import_module(f"parallel_lib.exercises.{name}") for name in modules}
    for chapter in ("ch07", "ch09"):
        assert all(item.solution is HIDDEN for item in fresh[chapter].EXERCISES)
    assert fresh["ch09"].check_cache_step(_step()).passed
    assert "lengths[b]-1" in fresh["ch09"].check_cache_step(_step(slots="lengths - 1")).message
    assert fresh["ch09"].check_gqa_decode_step(_decode()).passed
    assert fresh["ch07"].check_vocab_cross_entropy(_loss()).passed
    assert fresh["ch07"].check_tp_operators(_operators()).passed


@pytest.mark.parametrize("chapter", ["07", "09"])
def test_grade_notebook_scores_the_stubs_zero_and_the_reference_answers_full(chapter, tmp_path):
    import glob
    import inspect
    import textwrap

    import nbformat

    from parallel_lib.exercises import grade_notebook
    path = glob.glob(f"notebooks/{chapter}_*.ipynb")[0]
    assert [r.passed for r in grade_notebook(path)] == [False] * len(EXERCISES[chapter])
    nb = nbformat.read(path, as_version=4)
    for item in EXERCISES[chapter]:  # the student fills each stub cell with the reference answer
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source == item.stub.rstrip("\n"))
        if callable(item.solution):
            cell.source = "import torch\n" + textwrap.dedent(inspect.getsource(item.solution))
        else:
            cell.source = f"{item.answer_name} = {item.solution!r}"
    filled = tmp_path / f"{chapter}_filled.ipynb"
    nbformat.write(nb, filled)
    grades = grade_notebook(filled)
    assert all(r.passed for r in grades), grades


def test_hide_solutions_command_in_a_copy_of_the_course_leaves_checkers_that_still_check(tmp_path):
    """The real command on a copy of the package: solutions.py gone, chapters 07 and 09 still graded."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "parallel_lib", tmp_path / "parallel_lib", ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    hide = subprocess.run([sys.executable, "-m", "parallel_lib.exercises", "hide-solutions"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert hide.returncode == 0 and "removed" in hide.stdout, hide.stderr
    assert not (tmp_path / "parallel_lib" / "exercises" / "solutions.py").exists()
    script = """
import torch
from parallel_lib.exercises import EXERCISES, check_cache_step
from parallel_lib.exercises._core import HIDDEN
try:
    from parallel_lib.exercises import solutions
    print("importable")
except ImportError:
    print("not importable")
print(all(item.solution is HIDDEN for chapter in ("07", "09") for item in EXERCISES[chapter]))
def cache_step(k_cache, v_cache, k_new, v_new, lengths):
    rows = torch.arange(k_cache.shape[0])
    k_cache[rows, :, lengths] = k_new[:, :, 0]
    v_cache[rows, :, lengths] = v_new[:, :, 0]
    upto = int(lengths.max()) + 1
    return k_cache[:, :, :upto], v_cache[:, :, :upto], torch.arange(upto)[None, :] <= lengths[:, None]
print(check_cache_step(cache_step).passed)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.stdout.split() == ["not", "importable", "True", "True"], run.stdout + run.stderr
