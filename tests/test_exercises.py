"""Every exercise checker passes its reference solution and fails known-wrong ones helpfully.

Wrong answers are written as a student would write them in a notebook cell:
``notebook_function`` compiles source text the way IPython runs a cell (module
``__main__``, source kept in ``linecache``), so the checkers see exactly what they
see in a kernel, including ``check_average_token_gradients`` shipping the source to its ranks.
"""

import itertools
import linecache
import textwrap

import pytest
import torch

from parallel_lib import exercises
from parallel_lib.exercises import EXERCISES, CheckResult, exercise
from parallel_lib.exercises._core import is_stub
from parallel_lib.exercises._shipping import ship
from parallel_lib.exercises.solutions import rank_slice

ALL = [item for items in EXERCISES.values() for item in items]
# chapters whose exercise cells come from lab.section_cells
OURS = ["00", "01", "02", "03", "04", "05", "06", "07", "09", "10", "10b", "11", "12", "13"]
OURS_ALL = [item for chapter in OURS for item in EXERCISES[chapter]]
_cell_numbers = itertools.count()


def notebook_namespace(source: str) -> dict:
    """Run ``source`` as a notebook cell would: in ``__main__``, with its source findable by inspect."""
    filename = f"<ipython-input-{next(_cell_numbers)}>"
    source = textwrap.dedent(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def notebook_function(source: str):
    """The last function a notebook cell with ``source`` defines."""
    namespace = notebook_namespace(source)
    return [v for v in namespace.values() if callable(v) and getattr(v, "__module__", None) == "__main__"][-1]


# ----------------------------------------------------------------------------- the registry

def test_registry_covers_every_chapter_with_two_to_four_exercises():
    assert sorted(EXERCISES) == ["00", "01", "02", "03", "04", "05", "06", "07", "08a", "08b", "09", "10", "10b",
                                "11", "12", "13"]
    assert all(2 <= len(items) <= 4 for items in EXERCISES.values())
    names = [item.name for item in ALL]
    assert len(names) == len(set(names))
    assert {"average_token_gradients", "device_map_under_limit", "micro_batches_for_bubble", "wrong_dp_loop",
            "ring_exchange_order", "plan_parallelism"} <= set(names)
    assert len(OURS_ALL) >= 15 and all(item.title and item.title[-1] in ".?)" for item in OURS_ALL)  # sentences


# average_token_gradients is checked by its own test; chapter 06's gloo exercises in one launch each, with their
# wrong answers (tests/test_exercises_ch06_ch10.py)
_CHECKED_ELSEWHERE = {"average_token_gradients", "zero2_step", "clip_grad_norm_sharded"}


@pytest.mark.parametrize("item", [i for i in ALL if i.name not in _CHECKED_ELSEWHERE], ids=lambda i: i.name)
def test_reference_solution_passes(item):
    result = item.check(item.solution)
    assert isinstance(result, CheckResult)
    assert result.passed and result.failing_case is None, result.message
    assert result.message.startswith(f"✅ {item.name}: passed") and repr(result) == result.message


@pytest.mark.parametrize("item", ALL, ids=lambda i: i.name)
def test_unfilled_stub_is_reported_as_not_written(item):
    namespace = notebook_namespace(item.stub)  # the stub cell exactly as the notebook gets it
    answer = namespace[item.answer_name]
    if callable(answer):
        assert is_stub(answer)
    result = item.check(answer)  # a stub never reaches the ranks: instant even for average_token_gradients
    assert not result.passed
    assert "not written yet" in result.message or "not answered yet" in result.message, result.message


@pytest.mark.parametrize("item", ALL, ids=lambda i: i.name)
def test_check_cell_source_calls_the_checker_on_the_stub_name(item):
    assert item.check_source.endswith(f"{item.check.__name__}({item.answer_name})")
    assert getattr(exercises, item.check.__name__) is item.check
    assert exercise(item.name) is item


def test_every_answer_is_in_solutions_py():
    from parallel_lib.exercises import solutions
    for item in OURS_ALL:
        assert any(getattr(solutions, name) is item.solution for name in solutions.__all__), item.name
    assert exercises.check_clock_cycles(solutions._clock_cycles).passed


def test_unknown_exercise_lists_the_names():
    with pytest.raises(ValueError, match="no exercise is called 'nope'.*device_map_under_limit"):
        exercise("nope")


def test_non_callable_answer_is_a_type_error():
    with pytest.raises(TypeError, match=r"pass the function itself \(_clock_cycles, not _clock_cycles\(...\)\)"):
        exercises.check_clock_cycles([[(0, 0)]])


def test_exception_in_student_code_is_reported_with_its_case():
    fn = notebook_function("""
        def pipeline_bubble(p, m):
            return 1 / ((m + p - 1) / (p - 1))   # right, except with one stage
    """)
    result = exercises.check_pipeline_bubble(fn)
    assert not result.passed and result.failing_case == "pipeline_bubble(1, 5)"
    assert "raised ZeroDivisionError" in result.message


def test_exception_inside_a_returned_generator_is_reported_with_its_case():
    fn = notebook_function("""
        def _clock_cycles(num_batches, num_partitions):
            for k in range(num_batches + num_partitions - 1):
                yield [(k - j, j) for j in range(num_partitions) if k - j < num_batches // (num_partitions - 1)]
    """)
    result = exercises.check_clock_cycles(fn)
    assert result.failing_case == "_clock_cycles(1, 1)" and "raised ZeroDivisionError" in result.message


def test_function_that_forgets_to_return():
    fn = notebook_function("""
        def _clock_cycles(num_batches, num_partitions):
            ticks = [[(k - j, j) for j in range(num_partitions) if 0 <= k - j < num_batches]
                     for k in range(num_batches + num_partitions - 1)]
    """)
    result = exercises.check_clock_cycles(fn)
    assert "_clock_cycles(1, 1)" in result.message and "returned None" in result.message


# ----------------------------------------------------------------------------- known-wrong answers
# (exercise, the student's cell, what the message must contain)
WRONG = [
    ("rank_slice", """
        def rank_slice(numel, rank, world_size):
            size = numel // world_size
            return rank * size, (rank + 1) * size
     """, ["rank_slice(10, 0, 3)", "expected (0, 4), got (0, 3)", "belong to nobody"]),
    ("partition_indices", """
        import random
        def partition_indices(n, world_size, seed):   # the classic tutorial's DataPartitioner
            indices = list(range(n))
            random.Random(seed).shuffle(indices)
            parts = []
            for _ in range(world_size):
                size = int(1 / world_size * n)
                parts.append(indices[:size])
                indices = indices[size:]
            return parts
     """, ["partition_indices(10, 3, 1234)", "in no partition", "drops the remainder"]),
    ("partition_indices", """
        def partition_indices(n, world_size, seed):
            return [list(range(n))[r::world_size] for r in range(world_size)]
     """, ["partition_indices(10, 2, 1234)", "seed=1235 gives the same partitions", "not shuffled"]),
    ("partition_indices", """
        import random
        def partition_indices(n, world_size, seed):
            indices = list(range(n))
            random.shuffle(indices)
            return [indices[r::world_size] for r in range(world_size)]
     """, ["partition_indices(10, 2, 1234)", "same seed gave different partitions"]),
    ("local_batch_size", """
        def local_batch_size(global_batch_size, world_size):
            return global_batch_size // world_size
     """, ["local_batch_size(10, 4)", "expected a ValueError to be raised, got 2", "cannot be split evenly"]),
    ("local_batch_size", """
        def local_batch_size(global_batch_size, world_size):
            return global_batch_size / float(world_size)   # the classic tutorial's bsz
     """, ["local_batch_size(32, 2)", "use //"]),
    ("steps_per_epoch", """
        def steps_per_epoch(n, world_size, global_batch_size, drop_last=False):
            return n // global_batch_size
     """, ["steps_per_epoch(10, 3, 6, False)", "expected 2, got 1", "rounded up"]),
    ("ring_bytes_sent", """
        def ring_bytes_sent(nbytes, world_size):
            return 2 * nbytes
     """, ["ring_bytes_sent(4000000, 2)", "expected 4e+06, got 8e+06", "one chunk of S/N"]),
    ("ring_send_chunk", """
        def ring_send_chunk(rank, step, world_size):
            return (rank + step) % world_size
     """, ["ring_send_chunk(0, 1, 3)", "expected 2, got 1", "reduce-scatter"]),
    ("balanced_device_map", """
        import math
        def balanced_device_map(n_layers, n_devices):
            block = math.ceil(n_layers / n_devices)
            return {d: list(range(d * block, min((d + 1) * block, n_layers))) for d in range(n_devices)}
     """, ["balanced_device_map(12, 5)", "sizes [3, 3, 3, 3, 0]", "ceil(n_layers / n_devices) recipe"]),
    ("balanced_device_map", """
        def balanced_device_map(n_layers, n_devices):
            return {d: list(range(d, n_layers, n_devices)) for d in range(n_devices)}
     """, ["balanced_device_map(12, 2)", "consecutive and in device order"]),
    ("training_bytes", """
        def training_bytes(n_params, dtype="fp16", optimizer="adamw"):
            return 2 * 2 * n_params   # weights and gradients in fp16
     """, ["training_bytes(1000, 'fp16', 'adamw')", "expected 16000, got 4000",
           "weights 2 + gradients 2 + fp32 master copy 4 + optimizer states 8 = 16"]),
    ("clock_cycles", """
        def _clock_cycles(num_batches, num_partitions):
            for k in range(num_batches + num_partitions):
                yield [(k - j, j) for j in range(num_partitions) if 0 <= k - j < num_batches]
     """, ["_clock_cycles(1, 1)", "expected m + n - 1 = 1 tick(s), got 2"]),
    ("clock_cycles", """
        def _clock_cycles(num_batches, num_partitions):
            for k in range(num_batches + num_partitions - 1):
                yield [(j, k - j) for j in range(num_partitions) if 0 <= k - j < num_batches]
     """, ["_clock_cycles(4, 2)", "tick 2: expected [(1, 1), (2, 0)], got [(0, 2), (1, 1)]", "i + j"]),
    ("pipeline_bubble", """
        def pipeline_bubble(p, m):
            return (p - 1) / m
     """, ["pipeline_bubble(4, 8)", "expected 0.272727, got 0.375", "approximation for m >> p"]),
    ("gpipe_step_time", """
        def gpipe_step_time(p, m, forward, backward, comm):   # the bubble picture, hand-overs left out
            return (m + p - 1) * (forward + backward)
     """, ["gpipe_step_time(4, 6, 1.0, 2.0, 0.25)", "expected 28.5, got 27", "how many of them lie on the path"]),
    ("gpipe_step_time", """
        def gpipe_step_time(p, m, forward, backward, comm):   # a hand-over in every slot
            return (m + p - 1) * (forward + backward + 2 * comm)
     """, ["gpipe_step_time(4, 6, 1.0, 2.0, 0.25)", "does not hold its stage"]),
    ("one_f_one_b_order", """
        def one_f_one_b_order(stage, num_stages, num_micro_batches):
            return ([f"F{i}" for i in range(num_micro_batches)]
                    + [f"B{i}" for i in reversed(range(num_micro_batches))])
     """, ["one_f_one_b_order(0, 4, 8)", "GPipe's order"]),
    ("one_f_one_b_order", """
        def one_f_one_b_order(stage, num_stages, num_micro_batches):
            warmup = min(num_stages - stage, num_micro_batches)   # one too many
            order = [("F", i) for i in range(warmup)]
            for i in range(num_micro_batches - warmup):
                order += [("F", warmup + i), ("B", i)]
            return order + [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
     """, ["one_f_one_b_order(0, 4, 8)", "4 forwards first, not 5"]),
    ("bytes_per_device", """
        def bytes_per_device(n_params, pipeline_stages, data_replicas):
            return 16 * n_params / (pipeline_stages * data_replicas)
     """, ["bytes_per_device(1000000000, 1, 8)", "replicas do not share memory"]),
    ("device_map_under_limit", """
        import math
        def device_map_under_limit(layer_bytes, capacity):   # as if the model could be cut anywhere
            n = math.ceil(sum(layer_bytes) / capacity)
            blocks = len(layer_bytes) - 2
            per = math.ceil(blocks / n)
            return {d: list(range(d * per, min(blocks, (d + 1) * per))) for d in range(n)}
     """, ["device_map_under_limit([1.0, 1, 1, 1, 1, 0.5], 2.0)", "device 0 holds 3 bytes (with the embedding)",
           "ceil(total / capacity) = 3 devices assumes the model can be cut anywhere"]),
    ("device_map_under_limit", """
        def device_map_under_limit(layer_bytes, capacity):   # forgets the embedding and the head
            device_map, used = {0: []}, 0.0
            for i, size in enumerate(layer_bytes[1:-1]):
                if used + size > capacity:
                    device_map[len(device_map)], used = [], 0.0
                device_map[len(device_map) - 1].append(i)
                used += size
            return device_map
     """, ["device_map_under_limit([1.0, 1, 1, 1, 1, 0.5], 2.0)", "(with the embedding) > capacity 2"]),
    ("micro_batches_for_bubble", """
        def micro_batches_for_bubble(p, target, stage_costs):   # the formula, for equal stages only
            m = 1
            while (p - 1) / (m + p - 1) > target:
                m += 1
            return m
     """, ["micro_batches_for_bubble(4, 0.45, [(1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (2.0, 4.0)])",
           "expected 11, got 4", "assumes equal stages"]),
    ("ring_exchange_order", """
        def ring_exchange_order(rank, world_size):   # the article's order: everyone sends first
            return [("send", (rank + 1) % world_size), ("recv", (rank - 1) % world_size)]
     """, ["world_size=2", "deadlock: rank 0 waits in send(1); rank 1 waits in send(0)", "every rank sends first"]),
    ("ring_exchange_order", """
        def ring_exchange_order(rank, world_size):
            return [("recv", (rank - 1) % world_size), ("send", (rank + 2) % world_size)]
     """, ["ring_exchange_order(0, 2)", "send to the right neighbour"]),
    ("plan_parallelism", """
        def plan_parallelism(fits, n_gpus, n_layers):
            for stages in range(1, n_layers + 1):
                if fits(stages, 1):   # asks with one replica: more stages than needed (64 sequences in one pipeline: 8)
                    return stages, n_gpus // stages
     """, ["plan_parallelism(fits[llama-2-7b, 64 x 4096 tokens, 8 x 80 GiB], 8, 32)", "expected (4, 2), got (8, 1)",
           "fits(4, 2) is True too, with fewer stages"]),
    ("plan_parallelism", """
        def plan_parallelism(fits, n_gpus, n_layers):
            for stages in range(n_gpus, 0, -1):   # the most stages that fit
                if fits(stages, n_gpus // stages):
                    return stages, n_gpus // stages
     """, ["plan_parallelism(fits[gpt2 (124M), 32 x 1024 tokens, 8 x 16 GiB], 8, 12)", "expected (1, 8), got (8, 1)",
           "the bubble (p-1)/(m+p-1) grows with p"]),
    ("plan_parallelism", """
        def plan_parallelism(fits, n_gpus, n_layers):
            for stages in range(1, n_gpus + 1):   # forgets that a stage needs a block
                if fits(stages, n_gpus // stages):
                    return stages, n_gpus // stages
     """, ["fits[needs 3 stages, only 2 blocks], 8, 2)", "expected None (nothing fits), got (3, 2)",
           "2 blocks make at most 2 stages"]),
    ("plan_parallelism", """
        def plan_parallelism(fits, n_gpus, n_layers):
            for stages in range(1, min(n_gpus, n_layers) + 1):
                if fits(stages, n_gpus // stages):
                    return stages, 1   # one pipeline, the other GPUs idle
     """, ["expected (1, 8), got (1, 1)", "8 GPUs hold 8 replicas of 1 stages"]),
    ("shard_owner", """
        def owner_of(index, numel, world_size):
            return index * world_size // numel  # forgets the padding
     """, ["owner_of(5, 10, 4)", "expected 1, got 2", "ceil(10 / 4) = 3 elements each, padding included"]),
    ("shard_owner", """
        def owner_of(index, numel, world_size):
            return index // (numel // world_size)  # rounds the shard down
     """, ["owner_of(5, 10, 4)", "expected 1, got 2", "padding included, not numel / N"]),
    ("zero_bytes_per_rank", """
        def zero_bytes_per_rank(n_params, world_size, stage):
            return 16 * n_params / world_size if stage else 16 * n_params  # shards everything from stage 1
     """, ["zero_bytes_per_rank(1000000, 4, 1)", "stage 1 divides by N: optimizer states"]),
    ("zero3_bytes_sent", """
        def zero3_bytes_sent(n_params, world_size, bytes_per_param):
            return 2 * (world_size - 1) / world_size * n_params * bytes_per_param  # as data parallelism
     """, ["zero3_bytes_sent(1000, 2, 2)", "all-gathers the parameters a second time"]),
]


@pytest.mark.parametrize("name, source, fragments", WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_known_wrong_solution_fails_with_a_helpful_message(name, source, fragments):
    result = getattr(exercises, f"check_{name}")(notebook_function(source))  # clock_cycles: a checker, no exercise
    assert not result.passed and result.message.startswith(f"❌ {name}")
    assert result.failing_case and result.failing_case in result.message
    for fragment in fragments:
        assert fragment in result.message, result.message


@pytest.mark.parametrize("answer, fragments", [
    (("C", 3), ["is not right: the loop is wrong", "that is the mean"]),
    (("b", 2), ["is not right: the reason is wrong"]),
    ("B", ["must be a pair (letter, reason)"]),
])
def test_wrong_dp_loop_answers_never_reveal_the_loop(answer, fragments):
    result = exercises.check_wrong_dp_loop(answer)
    assert not result.passed and "('B', 1)" not in result.message
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_the_wrong_dp_loop_is_measured_not_typed():
    from parallel_lib.exercises.ch01 import _one_process, _train, _wrong_loops
    assert _wrong_loops() == ["B"]
    assert torch.equal(_train("A"), _one_process()) or torch.allclose(_train("A"), _one_process(), atol=1e-7)


def test_ring_exchange_replay_finds_the_cycle_and_accepts_an_alternating_ring():
    from parallel_lib.exercises.ch05 import replay_blocking
    sends_first = [[("send", (r + 1) % 3), ("recv", (r - 1) % 3)] for r in range(3)]
    assert replay_blocking(sends_first) == "rank 0 waits in send(1); rank 1 waits in send(2); rank 2 waits in send(0)"
    alternating = [ops if r % 2 == 0 else ops[::-1] for r, ops in enumerate(sends_first)]
    assert replay_blocking(alternating) is None
    assert exercises.check_ring_exchange_order(
        notebook_function("""
            def ring_exchange_order(rank, world_size):
                ops = [("send", (rank + 1) % world_size), ("recv", (rank - 1) % world_size)]
                return ops if rank % 2 == 0 else ops[::-1]
        """)).passed


@pytest.mark.parametrize("answer, fragments", [
    ([4.0, 30.0], ["expected [10, 60], got [4, 30]", "before the all-reduce"]),
    (torch.tensor([2.5, 15.0]), ["got [2.5, 15]", "that is the mean"]),
    (70.0, ["must be a list of two numbers"]),
])
def test_wrong_all_reduce_predictions(answer, fragments):
    result = exercises.check_all_reduce_prediction(answer)
    assert not result.passed
    for fragment in fragments:
        assert fragment in result.message, result.message


def test_clock_cycles_accepts_any_order_within_a_tick_and_lists():
    fn = notebook_function("""
        def _clock_cycles(num_batches, num_partitions):
            return [[(k - j, j) for j in reversed(range(num_partitions)) if 0 <= k - j < num_batches]
                    for k in range(num_batches + num_partitions - 1)]
    """)
    assert exercises.check_clock_cycles(fn).passed


# ----------------------------------------------------------------------------- average_gradients

def test_ship_keeps_the_modules_and_objects_a_notebook_function_uses():
    fn = notebook_function("""
        import torch.distributed as d
        from math import sqrt
        SCALE = 3
        def helper():
            return 1
        def f(x):
            return sqrt(x) * SCALE + d.is_available() + helper()
    """)
    shipped = ship(fn)
    assert shipped.function is None and shipped.modules == {"d": "torch.distributed"}
    assert set(shipped.objects) == {"sqrt", "SCALE"}  # helper() lives in __main__: it cannot travel
    with pytest.raises(NameError, match="helper"):
        shipped.load()(4.0)
    assert ship(rank_slice).function is rank_slice
    with pytest.raises(ValueError, match="cannot read the source of '<lambda>'"):
        ship(lambda model: None)


def test_average_token_gradients_reference_passes_on_real_ranks():
    result = exercises.check_average_token_gradients(exercise("average_token_gradients").solution)
    assert result.passed, result.message
    assert "3 gloo ranks holding 2, 5, 3 tokens" in result.message


def test_average_token_gradients_catches_the_plain_mean_on_real_ranks():
    fn = notebook_function("""
        import torch.distributed as dist
        def average_token_gradients(model, n_tokens):
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
                    param.grad /= dist.get_world_size()    # the article's average_gradients
    """)
    result = exercises.check_average_token_gradients(fn)
    assert not result.passed and result.failing_case == "'two linear layers'"
    assert "plain mean over the ranks" in result.message and "weigh each rank's gradient" in result.message


def test_average_token_gradients_hint_names_a_count_that_was_not_all_reduced():
    from parallel_lib.exercises.ch02 import _TOKENS, _WORLD, _wrong_answer
    local = [torch.full((2,), float(r + 1)) for r in range(_WORLD)]
    weighted = sum(t * g for t, g in zip(_TOKENS, local))
    expected = weighted / sum(_TOKENS)
    what, hint = _wrong_answer(weighted / _TOKENS[1], expected, local, rank=1)
    assert "own token count" in what and "all_reduce the count" in hint
    what, hint = _wrong_answer(weighted, expected, local, rank=0)
    assert "token-weighted sum" in what and str(sum(_TOKENS)) in hint


def test_average_token_gradients_crash_on_a_frozen_layer_is_caught_without_spawning():
    fn = notebook_function("""
        import torch
        import torch.distributed as dist
        def average_token_gradients(model, n_tokens):   # forgets frozen layers
            total = torch.tensor([float(n_tokens)])
            dist.all_reduce(total)
            for param in model.parameters():
                param.grad.data *= n_tokens / total.item()
                dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
    """)
    result = exercises.check_average_token_gradients(fn)
    assert not result.passed and not torch.distributed.is_initialized()
    assert "case 'a frozen first layer': raised AttributeError" in result.message
    assert "requires_grad=False" in result.message


# ----------------------------------------------------------------------------- float tolerance

def _in_float32(reference):
    """The reference solution, computed as a student's torch code would: a float32 tensor."""
    def answer(*args):
        return torch.tensor(float(reference(*args)), dtype=torch.float32)
    return answer


@pytest.mark.parametrize("name", ["ring_bytes_sent", "training_bytes", "gpipe_step_time", "bytes_per_device"])
def test_float32_answers_are_accepted(name):
    item = exercise(name)
    result = item.check(_in_float32(item.solution))
    assert result.passed, result.message


def test_numbers_that_differ_are_printed_with_the_digits_that_differ():
    from parallel_lib.exercises._core import same_number

    assert same_number(3 / 11, float(torch.tensor(3 / 11, dtype=torch.float32))) is None
    assert same_number(3 / 11, 0.2727268) == "expected 0.2727273, got 0.2727268"  # 6 digits would read equal
    assert same_number(3 / 11, 0.375) == "expected 0.272727, got 0.375"


# ----------------------------------------------------------------------------- notebooks, grading, graded labs

@pytest.mark.parametrize("chapter", OURS)
def test_each_notebook_holds_the_registry_exercise_cells(chapter):
    import glob

    import nbformat

    from parallel_lib.exercises.lab import SECTION_HEADING, section_cells
    path = glob.glob(f"notebooks/{chapter}_*.ipynb")[0]
    cells = nbformat.read(path, as_version=4).cells
    start = next(k for k, c in enumerate(cells) if c.source.startswith(SECTION_HEADING))
    assert [c.source for c in cells[start:]] == [c.source for c in section_cells(chapter)]


def test_grade_notebook_scores_the_solutions_and_the_stubs(tmp_path):
    import glob
    import inspect

    import nbformat

    from parallel_lib.exercises import grade_notebook
    path = glob.glob("notebooks/03_*.ipynb")[0]
    assert [r.passed for r in grade_notebook(path)] == [False] * len(EXERCISES["03"])
    nb = nbformat.read(path, as_version=4)
    for item in EXERCISES["03"]:  # the student fills each stub cell with the reference solution
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.source == item.stub.rstrip("\n"))
        cell.source = textwrap.dedent(inspect.getsource(item.solution))
    filled = tmp_path / "03_filled.ipynb"
    nbformat.write(nb, filled)
    grades = grade_notebook(filled)
    assert all(r.passed for r in grades) and repr(grades).endswith(f"score: {len(grades)} / {len(grades)}")


def test_a_graded_lab_without_solutions_still_checks(monkeypatch):
    import sys

    from parallel_lib.exercises._core import HIDDEN, solution
    monkeypatch.setitem(sys.modules, "parallel_lib.exercises.solutions", None)  # import now fails
    assert solution("rank_slice") is HIDDEN and "graded lab" in repr(HIDDEN)
    assert exercises.check_training_bytes(notebook_function("""
        def training_bytes(n_params, dtype="fp16", optimizer="adamw"):
            width = 4 if dtype == "fp32" else 2
            if optimizer is None:
                return width * n_params
            master = 4 if width == 2 else 0
            return (2 * width + master + 4 * {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}[optimizer]) * n_params
    """)).passed


def test_launch_cell_runs_a_worker_written_in_a_notebook_cell():
    from parallel_lib.exercises import launch_cell
    worker = notebook_function("""
        import torch
        import torch.distributed as dist
        def worker(rank, world_size, base):
            t = torch.tensor([base + rank])
            dist.all_reduce(t)
            return t.item()
    """)
    assert launch_cell(worker, 2, 10.0, timeout=60) == [21.0, 21.0]


@pytest.mark.parametrize("source, fragments", [
    ("""
        import torch.distributed as dist
        def attach_bucketed_allreduce(model, bucket_bytes):   # correct, but only after backward
            def finish():
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            return finish
     """, ["all 12 all-reduce(s) started after loss.backward() returned: nothing overlapped",
           "register_post_accumulate_grad_hook"]),
    ("""
        import torch.distributed as dist
        def attach_bucketed_allreduce(model, bucket_bytes):   # overlapped, but one call per tensor
            handles = []
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(
                    lambda q: handles.append((q, dist.all_reduce(q.grad, async_op=True))))
            def finish():
                for q, handle in handles:
                    handle.wait()
                    q.grad /= dist.get_world_size()
            return finish
     """, ["12 all-reduces for 12 gradient tensors: one per tensor, no buckets", "buckets of about"]),
])
def test_bucketed_allreduce_without_overlap_or_buckets_is_caught_on_real_ranks(source, fragments):
    result = exercises.check_bucketed_allreduce(notebook_function(source))
    assert not result.passed
    for fragment in fragments:
        assert fragment in result.message, result.message


# ----------------------------------------------------------------------------- chapter 07

WRONG_CH07 = [
    ("row_parallel_forward", """
        def row_parallel_forward(x_mine, weight_mine, bias, all_reduce):
            return all_reduce(x_mine @ weight_mine.T + bias)   # bias inside the sum
     """, ["2 ranks, seed 0", "the bias was summed 2 times"]),
    ("row_parallel_forward", """
        def row_parallel_forward(x_mine, weight_mine, bias, all_reduce):
            return x_mine @ weight_mine.T + bias               # no all-reduce
     """, ["partial product", "sum them with all_reduce"]),
    ("row_parallel_forward", """
        def row_parallel_forward(x_mine, weight_mine, bias, all_reduce):
            y = x_mine @ weight_mine.T
            return all_reduce(y) + bias if weight_mine.sum() > 0 else y + bias   # only some ranks call it
     """, ["never called it"]),
]


# ----------------------------------------------------------------------------- chapter 09

WRONG_CH09 = [
    ("largest_batch", """
        def largest_batch(kv_budget_bytes, n_layers, n_heads, kv_heads, head_dim, seq_len, bytes_per_element, tp):
            return kv_budget_bytes // (n_layers * kv_heads // tp * head_dim * bytes_per_element * seq_len)  # no V
     """, ["expected 32, got 64", "a key AND a value"]),
    ("largest_batch", """
        def largest_batch(kv_budget_bytes, n_layers, n_heads, kv_heads, head_dim, seq_len, bytes_per_element, tp):
            return kv_budget_bytes // (2 * n_layers * n_heads // tp * head_dim * bytes_per_element * seq_len)
     """, ["expected 51, got 6", "kv_heads heads, not n_heads"]),
    ("largest_batch", """
        def largest_batch(kv_budget_bytes, n_layers, n_heads, kv_heads, head_dim, seq_len, bytes_per_element, tp):
            return kv_budget_bytes // (2 * n_layers * kv_heads * head_dim * bytes_per_element * seq_len)  # whole cache
     """, ["only its own KV heads"]),
    ("largest_batch", """
        def largest_batch(kv_budget_bytes, n_layers, n_heads, kv_heads, head_dim, seq_len, bytes_per_element, tp):
            return kv_budget_bytes // (2 * n_layers * (kv_heads // tp) * head_dim * bytes_per_element * seq_len)
     """, ["raised ZeroDivisionError"]),  # 16 ranks, 8 KV heads: a rank keeps one head, not zero
]


WRONG_BY_EXERCISE = WRONG_CH07 + WRONG_CH09  # checked through the registry's exercise, not a bare checker


@pytest.mark.parametrize("name, source, fragments", WRONG_BY_EXERCISE,
                         ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG_BY_EXERCISE)])
def test_known_wrong_exercise_solution_fails_with_a_helpful_message(name, source, fragments):
    result = exercise(name).check(notebook_function(source))
    assert not result.passed and result.message.startswith(f"❌ {name}")
    for fragment in fragments:
        assert fragment in result.message, result.message


@pytest.mark.parametrize("answer, fragment", [((0.5, 2.0), None), ((1.0, 4.0), "cross both stages"),
                                              ((0.5, 1.0), "both stages are busy"), ((0.5, 4.0), "at most one group"),
                                              ("2x", "must be a pair")])
def test_pipeline_throughput_answers(answer, fragment):
    result = exercises.check_pipeline_throughput(answer)
    assert result.passed == (fragment is None)
    assert fragment is None or fragment in result.message, result.message


# ----------------------------------------------------------------------------- chapter 10

@pytest.mark.parametrize("answer, fragment", [
    (dict(dp=32, tp=1, pp=1, zero=3), None),                               # the planner's best: gathers prefetched
    (dict(dp=16, tp=2, pp=1, zero=3), None),                               # within 10 % of it
    (dict(dp=32, tp=1, pp=1, zero=0), "does not fit"),                     # plain DP: 16 bytes per parameter
    (dict(dp=32, tp=1, pp=1, zero=1), "data-parallel (ZeRO) collectives"),  # fits; its reduction shows across nodes
    (dict(dp=2, tp=1, pp=16, zero=1), "pipeline bubble"),                  # deep pipeline
    (dict(dp=4, tp=8, pp=1, zero=1), "tensor-parallel all-reduces"),
    (dict(dp=2, tp=16, pp=1, zero=0), "more than one node"),
    (dict(dp=8, tp=2, pp=1, zero=0), "the budget is 32 GPUs"),
    ((8, 4, 1), "a dict with keys dp, tp, pp"),
])
def test_choose_layout_answers(answer, fragment):
    result = exercises.check_choose_layout(answer)
    assert result.passed == (fragment is None), result.message
    assert fragment is None or fragment in result.message, result.message


@pytest.mark.parametrize("answer, fragment", [
    (("optimizer", 1), None), (("Optimizer states", 1), None),
    (("activations", 1), "only one micro-batch's activations"), (("parameters", 1), "fp32 master copy"),
    (("gradients", 2), "what keeps 12"), (("optimizer", 3), "a lower stage already does"),
    (("optimizer", 0), "still holds more than the card"), (("memory", 1), "none of parameters"),
    ("optimizer", "must be a pair"),
])
def test_oom_term_answers(answer, fragment):
    result = exercises.check_oom_term(answer)
    assert result.passed == (fragment is None), result.message
    assert fragment is None or fragment in result.message, result.message
