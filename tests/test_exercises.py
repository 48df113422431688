"""Every exercise checker passes its reference solution and fails known-wrong ones helpfully.

Wrong answers are written as a student would write them in a notebook cell:
``notebook_function`` compiles source text the way IPython runs a cell (module
``__main__``, source kept in ``linecache``), so the checkers see exactly what they
see in a kernel, including ``check_average_gradients`` shipping the source to its ranks.
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
    assert sorted(EXERCISES) == ["00", "01", "02", "03", "04", "05", "06", "07", "08"]
    assert all(2 <= len(items) <= 4 for items in EXERCISES.values())
    names = [item.name for item in ALL]
    assert len(names) == len(set(names))
    assert {"average_gradients", "clock_cycles", "balanced_device_map", "pipeline_bubble"} <= set(names)


@pytest.mark.parametrize("item", [i for i in ALL if i.name != "average_gradients"], ids=lambda i: i.name)
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
    result = item.check(answer)  # a stub never reaches the ranks: instant even for average_gradients
    assert not result.passed
    assert "not written yet" in result.message or "not answered yet" in result.message, result.message


@pytest.mark.parametrize("item", ALL, ids=lambda i: i.name)
def test_check_cell_source_calls_the_checker_on_the_stub_name(item):
    assert item.check_source.endswith(f"{item.check.__name__}({item.answer_name})")
    assert getattr(exercises, item.check.__name__) is item.check
    assert exercise(item.name) is item


def test_unknown_exercise_lists_the_names():
    with pytest.raises(ValueError, match="no exercise is called 'nope'.*clock_cycles"):
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
    ("plan_parallelism", """
        import math
        def plan_parallelism(n_params, gpu_bytes, n_gpus):
            stages = math.ceil(4 * n_params / gpu_bytes)   # the fp32 weights only
            return (stages, n_gpus // stages) if stages <= n_gpus else None
     """, ["plan_parallelism(6738415616, 17179869184, 8)", "expected (7, 1), got (2, 4)", "= 7 GPU(s)"]),
    ("plan_parallelism", """
        import math
        def plan_parallelism(n_params, gpu_bytes, n_gpus):
            stages = math.ceil(16 * n_params / gpu_bytes)
            return stages, n_gpus // stages   # forgets the models that do not fit
     """, ["plan_parallelism(68976648192, 85899345920, 8)", "expected None (it does not fit), got (13, 0)"]),
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
    result = exercise(name).check(notebook_function(source))
    assert not result.passed and result.message.startswith(f"❌ {name}")
    assert result.failing_case and result.failing_case in result.message
    for fragment in fragments:
        assert fragment in result.message, result.message


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


def test_average_gradients_reference_passes_on_real_ranks():
    result = exercises.check_average_gradients(exercise("average_gradients").solution)
    assert result.passed, result.message
    assert "3 gloo ranks" in result.message


def test_average_gradients_that_sums_is_caught_on_real_ranks():
    fn = notebook_function("""
        import torch.distributed as dist
        def average_gradients(model):
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
    """)
    result = exercises.check_average_gradients(fn)
    assert not result.passed and result.failing_case == "'two linear layers'"
    assert "is the sum over the 3 ranks" in result.message and "divide by dist.get_world_size()" in result.message


def test_average_gradients_crash_on_a_frozen_layer_is_caught_without_spawning():
    fn = notebook_function("""
        import torch.distributed as dist
        def average_gradients(model):   # the classic tutorial's loop
            size = float(dist.get_world_size())
            for param in model.parameters():
                dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
                param.grad.data /= size
    """)
    result = exercises.check_average_gradients(fn)
    assert not result.passed and not torch.distributed.is_initialized()
    assert "case 'a frozen first layer': raised AttributeError" in result.message
    assert "requires_grad=False" in result.message


# ----------------------------------------------------------------------------- float tolerance

def _in_float32(reference):
    """The reference solution, computed as a student's torch code would: a float32 tensor."""
    def answer(*args):
        return torch.tensor(float(reference(*args)), dtype=torch.float32)
    return answer


@pytest.mark.parametrize("name", ["ring_bytes_sent", "training_bytes", "pipeline_bubble", "bytes_per_device"])
def test_float32_answers_are_accepted(name):
    item = exercise(name)
    result = item.check(_in_float32(item.solution))
    assert result.passed, result.message


def test_numbers_that_differ_are_printed_with_the_digits_that_differ():
    from parallel_lib.exercises._core import same_number

    assert same_number(3 / 11, float(torch.tensor(3 / 11, dtype=torch.float32))) is None
    assert same_number(3 / 11, 0.2727268) == "expected 0.2727273, got 0.2727268"  # 6 digits would read equal
    assert same_number(3 / 11, 0.375) == "expected 0.272727, got 0.375"


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
    ("tp_block_bytes", """
        def tp_block_bytes(batch, seq, hidden, n_layer, tp, bytes_per_element=4):
            return n_layer * 2 * 2 * (tp - 1) / tp * batch * seq * hidden * bytes_per_element   # forward only
     """, ["tp_block_bytes(1, 1, 1, 1, 2)", "the backward pass has its two all-reduces"]),
]


@pytest.mark.parametrize("name, source, fragments", WRONG_CH07, ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG_CH07)])
def test_known_wrong_ch07_solution_fails_with_a_helpful_message(name, source, fragments):
    result = exercise(name).check(notebook_function(source))
    assert not result.passed and result.message.startswith(f"❌ {name}")
    for fragment in fragments:
        assert fragment in result.message, result.message


@pytest.mark.parametrize("answer, fragment", [("g forward", "outputs themselves would be partial"),
                                              ("F Backward", None), (3, "must be one of the strings")])
def test_missing_operator_answers(answer, fragment):
    result = exercises.check_missing_operator(answer)
    assert result.passed == (fragment is None)
    assert fragment is None or fragment in result.message, result.message
