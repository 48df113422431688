"""Exercises for chapter 09: the largest batch a KV-cache budget holds; one decode step of grouped-query
attention with a KV cache, against Hugging Face's LLaMA attention, and the cache's write and read for
requests of different lengths, against the library (both in ``ch09_decode``); and a committed prediction
of a pipeline's throughput at 1 and 4 requests (section 3 measured it). The reference answers are in
``solutions.py``."""

from __future__ import annotations

from typing import Any

from parallel_lib.cost.shape import GPTShape
from parallel_lib.exercises._core import (Case, CheckResult, Exercise, as_int, as_number, check_function, check_value,
                                         solution)
from parallel_lib.exercises.ch09_decode import (CACHE_STEP_STUB, GQA_DECODE_STUB, check_cache_step,
                                                check_gqa_decode_step)
from parallel_lib.inference.cost_model import Hardware, Workload, predict
from parallel_lib.inference.serving_memory import kv_cache_bytes

__all__ = ["check_largest_batch", "check_gqa_decode_step", "check_cache_step", "check_pipeline_throughput",
           "EXERCISES"]

LARGEST_BATCH_STUB = '''\
def largest_batch(kv_budget_bytes, n_layers, n_heads, kv_heads, head_dim, seq_len, bytes_per_element, tp):
    """How many requests of seq_len tokens each can keep their KV cache within kv_budget_bytes on ONE
    tensor-parallel rank (tp ranks split the KV heads; with more ranks than KV heads, each rank keeps one)?
    kv_heads < n_heads is grouped-query attention. Return a whole number."""
    ...  # your code here
'''

PIPELINE_STUB = '''\
# A 2-stage pipeline (pp) serves requests in groups, at most one group per stage (4 requests: 2 groups of 2).
# Suppose a stage's step takes the same time t whatever the size of the group (overhead-bound, as on this
# CPU) and hand-overs are free. In steady decoding, how many tokens per t does the whole pipeline
# deliver with 1 request in flight, and with 4?  Commit to your numbers, then compare their ratio with
# the pp rows that section 5 measured on this machine.
PIPELINE_THROUGHPUT = None  # your answer: (tokens per t at 1 request, tokens per t at 4 requests)
'''

def _kv_shape(n_layers: int, n_heads: int, kv_heads: int, head_dim: int) -> GPTShape:
    return GPTShape(n_layers, n_heads * head_dim, n_heads, 1, 1, kv_heads=kv_heads)


def _largest(budget: int, n_layers: int, n_heads: int, kv_heads: int, head_dim: int, seq_len: int, width: int,
             tp: int) -> int:
    """The library's answer: the budget over one request's cache on a rank (serving_memory.kv_cache_bytes)."""
    dtype = {2: "fp16", 4: "fp32"}[width]
    return budget // kv_cache_bytes(_kv_shape(n_layers, n_heads, kv_heads, head_dim), seq_len, dtype, tp=tp)


def check_largest_batch(fn: Any) -> CheckResult:
    """Check ``largest_batch`` against :func:`parallel_lib.inference.serving_memory.kv_cache_bytes`."""
    gib = 2**30
    shapes = [(64 * gib, 32, 32, 32, 128, 4096, 2, 1),    # LLaMA-2-7B: 2 GiB per 4k request
              (gib, 32, 32, 32, 128, 4096, 2, 1),         # not even one request
              (10**9, 4, 4, 4, 16, 128, 4, 2),            # the tiny GPT-2, fp32, 2 ranks
              (64 * gib, 80, 64, 8, 128, 4096, 2, 1),     # LLaMA-2-70B: 8 KV heads
              (64 * gib, 80, 64, 8, 128, 4096, 2, 4),
              (64 * gib, 80, 64, 8, 128, 4096, 2, 16)]    # more ranks than KV heads
    cases = [Case(shape, _largest(*shape)) for shape in shapes]

    def hint(args: tuple, got: Any) -> str:
        budget, layers, heads, kv_heads, d, s, width, tp = args
        expected = _largest(*args)
        if isinstance(got, int) and got == budget // (layers * max(kv_heads // tp, 1) * d * width * s):
            return "a layer caches a key AND a value vector per KV head and token: a factor 2"
        as_if_all_heads = _largest(budget, layers, heads, heads, d, s, width, tp)
        if isinstance(got, int) and kv_heads != heads and got == as_if_all_heads:
            return "grouped-query attention caches kv_heads heads, not n_heads: the query heads share them"
        if isinstance(got, int) and tp > 1 and got == _largest(budget, layers, heads, kv_heads, d, s, width, 1):
            return "each tensor-parallel rank keeps only its own KV heads"
        if expected == 0 and got != 0:
            return "one request's cache is larger than the budget: not even one fits"
        return "budget // (2 · layers · KV heads on this rank · head_dim · bytes · seq_len)"
    return check_function("largest_batch", fn, "largest_batch", cases, normalise=as_int, hint=hint)


def _pipeline_reference() -> tuple[float, float]:
    """Tokens per unit step time of a 2-stage pipeline at 1 and 4 requests, from the cost model itself."""
    shape = GPTShape(2, 64, 1, 8, 8)  # 2 layers of width 64, one head, 8 tokens, 8 positions
    # compute and memory free, hand-overs free, one time unit per stage step (one layer per stage)
    hw = Hardware("unit stages", 1e30, 1e30, 0.0, 1e30, 0.0, overhead=1.0)
    return tuple(c / predict(shape, "pp", 2, Workload(1, 2, c), hw).tpot for c in (1, 4))  # type: ignore[return-value]


def check_pipeline_throughput(answer: Any) -> CheckResult:
    """The committed prediction against the cost model's steady-state answer."""
    expected = _pipeline_reference()

    def normalise(value: Any) -> tuple[float, float]:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
            raise TypeError("a pair (tokens per t at 1 request, tokens per t at 4 requests)")
        return as_number(value[0]), as_number(value[1])

    def compare(want: tuple[float, float], got: tuple[float, float]) -> Any:
        return None if all(abs(a - b) < 1e-6 for a, b in zip(want, got)) else f"expected {want}, got {got}"

    def hint(got: tuple[float, float]) -> str:
        if abs(got[0] - 1.0) < 1e-6:
            return "one request's token must cross both stages before its next token can start: 2t per token"
        if abs(got[1] - 4.0) < 1e-6 or abs(got[1] - 8.0) < 1e-6:
            return "at most one group per stage: 4 requests make 2 groups of 2, and each group still needs 2t per token"
        if abs(got[1] - got[0] * 2) < 1e-6 or abs(got[1] - 1.0) < 1e-6:
            return ("while stage 1 works on group 0, stage 0 works on group 1: both stages are busy, and each "
                    "group step yields 2 tokens")
        return "count the tokens leaving the last stage during 2t, with both stages busy"
    return check_value("pipeline_throughput", answer, "PIPELINE_THROUGHPUT", expected, normalise=normalise,
                       compare=compare, hint=hint)


EXERCISES = [
    Exercise("largest_batch", check_largest_batch, LARGEST_BATCH_STUB, solution("largest_batch"),
             "How many requests fit a KV-cache budget on one rank?"),
    Exercise("gqa_decode_step", check_gqa_decode_step, GQA_DECODE_STUB, solution("gqa_decode_step"),
             "Write one decode step of grouped-query attention with a KV cache: store the new token's key and "
             "value, attend over the cached tokens and itself, several query heads sharing each KV head. The "
             "checker compares with Hugging Face's `LlamaAttention` (fewer KV heads than query heads)."),
    Exercise("cache_step", check_cache_step, CACHE_STEP_STUB, solution("cache_step"),
             "Write the KV cache's write and read for one decode step of requests with different prompt lengths "
             "(section 2's layout: no padding in front). The checker compares with the library's `KVCache` and "
             "the mask of `Group.decode`."),
    Exercise("pipeline_throughput", check_pipeline_throughput, PIPELINE_STUB, solution("PIPELINE_THROUGHPUT"),
             "Predict a 2-stage pipeline's throughput at 1 and 4 requests, then compare with what section 5 "
             "measured."),
]
