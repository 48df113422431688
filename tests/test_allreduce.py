"""Tests for parallel_lib.data_parallel.ring and parallel_lib.data_parallel.allreduce.

Pure parts (the ring's step record, the cost model, bucketing) are checked against
literal tables and properties. The collectives run in real gloo ranks: each world
size is ONE launch that runs every case (sizes, dtypes, bad inputs, gradient-sync
methods), because starting ranks costs seconds and a case costs milliseconds.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from parallel_lib.data_parallel import (
    BucketedAllReduce,
    algorithm_bandwidth,
    allreduce_cost,
    average_gradients,
    bus_bandwidth,
    fit_allreduce_cost,
    replay_contributions,
    ring_all_gather,
    ring_all_reduce,
    ring_chunks,
    ring_reduce_scatter,
    ring_steps,
)
from parallel_lib.runtime import launch
from parallel_lib.runtime.compat import all_gather_single, reduce_scatter_single

RING_SIZES = (1, 7, 1000, 2**20 + 3)
VOCAB = 97


def _tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    # imported here: ranks spawned for the ring cases import this module but never need
    # transformers, whose import costs seconds per rank
    from parallel_lib.common import build_gpt2
    return build_gpt2("tiny", vocab_size=VOCAB, seed=seed)


# --- the step record: pure data ---------------------------------------------------------------

def test_ring_chunks_spread_the_remainder_over_the_first_chunks():
    assert ring_chunks(3, 7) == [(0, 3), (3, 5), (5, 7)]
    assert ring_chunks(4, 2) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # fewer elements than ranks
    assert ring_chunks(1, 5) == [(0, 5)]
    assert ring_chunks(2, 0) == [(0, 0), (0, 0)]


def test_ring_steps_match_the_table_in_the_module_docstring():
    steps = ring_steps(3, 7)
    sent = [(s.phase, s.index, [t.chunk for t in s.transfers]) for s in steps]
    assert sent == [("reduce-scatter", 0, [0, 1, 2]), ("reduce-scatter", 1, [2, 0, 1]),
                    ("all-gather", 0, [1, 2, 0]), ("all-gather", 1, [0, 1, 2])]
    first = steps[0].transfers
    assert [(t.src, t.dst, t.start, t.stop) for t in first] == [(0, 1, 0, 3), (1, 2, 3, 5), (2, 0, 5, 7)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [0, 1, 5, 1000])
def test_ring_steps_are_a_complete_all_reduce(world_size, numel):
    steps = ring_steps(world_size, numel)
    n = world_size
    assert len(steps) == 2 * (n - 1)
    for step in steps:  # every rank sends once, to its right neighbour, and receives once
        assert [(t.src, t.dst) for t in step.transfers] == [(r, (r + 1) % n) for r in range(n)]
        assert all((t.start, t.stop) == ring_chunks(n, numel)[t.chunk] for t in step.transfers)
    everyone = frozenset(range(n))
    after_reduce_scatter = replay_contributions(n, steps[:n - 1])
    for r in range(n):  # rank r ends the reduce-scatter owning the full sum of chunk r+1
        assert after_reduce_scatter[r][(r + 1) % n] == everyone
    assert replay_contributions(n, steps) == [[everyone] * n for _ in range(n)]
    # the same record, cut short, is not yet an all-reduce: the replay can tell
    if n > 1:
        assert replay_contributions(n, steps[:-1]) != [[everyone] * n for _ in range(n)]


@pytest.mark.parametrize("args, match", [((0, 4), "world_size"), ((2, -1), "numel"), ((2.0, 4), "world_size")])
def test_ring_steps_reject_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        ring_steps(*args)


# --- cost model ---------------------------------------------------------------------------------

def test_allreduce_cost_is_the_ring_model():
    assert allreduce_cost(1e6, 1, bandwidth=1e9, latency=1e-5) == 0.0
    assert allreduce_cost(1e6, 2, bandwidth=1e9, latency=1e-5) == pytest.approx(1e-3 + 2e-5)
    assert allreduce_cost(1e6, 4, bandwidth=1e9, latency=0.0) == pytest.approx(1.5e-3)
    # bytes per link approach 2S as N grows; latency grows linearly with N
    assert allreduce_cost(1e6, 1000, bandwidth=1e9, latency=0.0) == pytest.approx(2e-3, rel=1e-2)
    assert bus_bandwidth(10.0, 1) == 0.0 and bus_bandwidth(10.0, 2) == 10.0 and bus_bandwidth(10.0, 4) == 15.0
    assert algorithm_bandwidth(4e6, 2e-3) == 2e9


def test_fit_allreduce_cost_recovers_bandwidth_and_latency():
    sizes = [2.0**k for k in range(10, 27, 2)]
    times = [allreduce_cost(s, 3, bandwidth=2e9, latency=5e-5) for s in sizes]
    bandwidth, latency = fit_allreduce_cost(sizes, times, 3)
    assert bandwidth == pytest.approx(2e9, rel=1e-6) and latency == pytest.approx(5e-5, rel=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda: allreduce_cost(-1, 2, 1e9, 0), "nbytes"),
    (lambda: allreduce_cost(1, 0, 1e9, 0), "world_size"),
    (lambda: allreduce_cost(1, 2, 0, 0), "bandwidth"),
    (lambda: allreduce_cost(1, 2, 1e9, -1), "latency"),
    (lambda: algorithm_bandwidth(1, 0), "seconds"),
    (lambda: fit_allreduce_cost([1, 1], [1, 2], 2), "distinct"),
    (lambda: fit_allreduce_cost([1, 2], [2, 1], 2), "slope"),
])
def test_cost_model_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- bucketing and errors without ranks -----------------------------------------------------------

def test_buckets_hold_parameters_in_reverse_order_under_the_cap():
    model = _tiny_gpt2()
    params = list(model.parameters())
    cap_mb = 0.05
    sync = BucketedAllReduce(model, bucket_cap_mb=cap_mb, overlap=False)
    flat = [p for b in sync.buckets for p in b.params]
    assert [id(p) for p in flat] == [id(p) for p in params[::-1]]  # each parameter once, tied ones too
    assert len(sync.buckets) > 1
    for b in sync.buckets:
        nbytes = sum(p.numel() * p.element_size() for p in b.params)
        assert nbytes <= cap_mb * 2**20 or len(b.params) == 1  # an oversized parameter sits alone
        assert b.buffer.numel() == sum(p.numel() for p in b.params)
    assert len(BucketedAllReduce(model).buckets) == 1  # the tiny model fits DDP's 25 MB


def test_collectives_without_a_process_group_fail_clearly():
    model = _tiny_gpt2()
    with pytest.raises(RuntimeError, match="ring_all_reduce needs an initialised process group"):
        ring_all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError, match="average_gradients needs an initialised process group"):
        average_gradients(model)
    with BucketedAllReduce(model) as sync, pytest.raises(RuntimeError, match="process group"):
        sync.synchronize()
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedAllReduce(model, bucket_cap_mb=0)


# --- in real ranks ---------------------------------------------------------------------------------

def _expect_error(exc_type: type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


def ring_cases(rank: int, world_size: int) -> dict:
    """Every ring case of one world size: max |ring - dist.all_reduce| per case, and error messages."""
    diffs = {}
    for numel in RING_SIZES:
        for dtype in (torch.float32, torch.float64):
            g = torch.Generator().manual_seed(1000 * rank + numel)
            x = torch.randn(numel, generator=g, dtype=dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            out = ring_all_reduce(x)
            assert out is x  # in place, like dist.all_reduce
            diffs[(numel, str(dtype))] = (x - expected).abs().max().item()
    matrix = torch.arange(12.0).reshape(3, 4) * (rank + 1)  # any shape: reduced as a flat buffer
    ring_all_reduce(matrix)
    expected_matrix = torch.arange(12.0).reshape(3, 4) * sum(range(1, world_size + 1))
    diffs[("3x4", "int-valued")] = (matrix - expected_matrix).abs().max().item()
    errors = dict(noncontiguous=_expect_error(ValueError, ring_all_reduce, torch.ones(4, 3).t()),
                  device=_expect_error(ValueError, ring_all_reduce, torch.ones(4, device="meta")),
                  type=_expect_error(TypeError, ring_all_reduce, [1.0, 2.0]))
    after = torch.ones(5)  # the group still works after the rejected calls
    ring_all_reduce(after)
    return dict(diffs=diffs, errors=errors, after=after.tolist())


def _recorded_batches(fn, *args) -> tuple[list[list[tuple[str, int, int]]], float, float]:
    """Run ``fn(*args)``: each ``batch_isend_irecv`` call as [(op, peer, numel)], batched and counted send bytes."""
    from parallel_lib.runtime import count_collectives

    batches = []
    original = dist.batch_isend_irecv

    def recording(ops):
        batches.append([(getattr(op.op, "__name__", ""), op.peer, op.tensor.numel()) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        with count_collectives() as counter:  # counts sends issued outside a batch too
            fn(*args)
    finally:
        dist.batch_isend_irecv = original
    batched = 4.0 * sum(n for batch in batches for name, _, n in batch if name == "isend")
    return batches, batched, counter.wire_bytes("send")


def ring_halves_and_batches(rank: int, world_size: int) -> dict:
    """The ring halves against torch's, a 64 MB all-reduce, and the batches each step issues."""
    out: dict = {}
    for shard in (1, 5, 2**18 + 1):
        g = torch.Generator().manual_seed(rank * 7 + shard)
        x = torch.randn(shard * world_size, generator=g)
        before = x.clone()
        mine, theirs = torch.empty(shard), torch.empty(shard)
        ring_reduce_scatter(mine, x)
        reduce_scatter_single(theirs, x.clone())
        gathered, expected = torch.empty(shard * world_size), torch.empty(shard * world_size)
        ring_all_gather(gathered, mine)
        all_gather_single(expected, mine)
        out[shard] = ((mine - theirs).abs().max().item(), (gathered - expected).abs().max().item(),
                      torch.equal(x, before))
    out["size_error"] = _expect_error(ValueError, ring_reduce_scatter, torch.empty(3), torch.empty(3 * world_size + 1))
    big = torch.full((16 * 2**20,), float(rank + 1))  # 64 MB of float32, as a GPU bucket would be
    batches, batched, counted = _recorded_batches(ring_all_reduce, big)
    out["big"] = (big.min().item(), big.max().item(), len(batches), batched, counted)
    batches, _, _ = _recorded_batches(ring_all_reduce, torch.ones(10 * world_size))
    out["batches"] = batches
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def gradient_sync_methods(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """The averaged gradients of one tiny GPT-2 step under every sync method, on this rank."""
    base = _tiny_gpt2()
    g = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=g)  # a different shard per rank

    def backward(model: torch.nn.Module) -> None:
        model(input_ids=input_ids, labels=input_ids).loss.backward()

    results = {}
    local = copy.deepcopy(base)
    backward(local)
    results["local"] = _grads(local)
    syncs = {"naive": lambda m: average_gradients,
             "bucketed": lambda m: BucketedAllReduce(m),
             "bucketed-small-no-overlap": lambda m: BucketedAllReduce(m, bucket_cap_mb=0.01, overlap=False),
             "bucketed-small-overlap": lambda m: BucketedAllReduce(m, bucket_cap_mb=0.01),
             "ring": lambda m: BucketedAllReduce(m, bucket_cap_mb=0.05, overlap=False, all_reduce=ring_all_reduce)}
    for name, make in syncs.items():
        model = copy.deepcopy(base)
        sync = make(model)
        for _ in range(2):  # twice: hooks and buckets must reset between steps
            model.zero_grad(set_to_none=True)
            backward(model)
            sync(model)
        results[name] = _grads(model)
    ddp = DistributedDataParallel(copy.deepcopy(base))
    backward(ddp)
    results["ddp"] = _grads(ddp.module)
    return results


def rank_cases(rank: int, world_size: int, with_gradients: bool) -> dict:
    """All multi-rank cases of one world size, so that they share one launch."""
    return dict(ring=ring_cases(rank, world_size),
                halves=ring_halves_and_batches(rank, world_size) if world_size < 4 else None,
                gradients=gradient_sync_methods(rank, world_size) if with_gradients else None)


@pytest.fixture(scope="module", params=[2, 3, 4])
def launched(request) -> tuple[int, list[dict]]:
    """(world_size, each rank's results of rank_cases): one launch per world size for this file."""
    world_size = request.param
    return world_size, launch(rank_cases, world_size, world_size < 4, timeout=180)


def test_ring_all_reduce_equals_dist_all_reduce(launched):
    world_size, results = launched
    for rank, result in enumerate(r["ring"] for r in results):
        for case, diff in result["diffs"].items():
            assert diff <= 1e-5 * world_size, f"rank {rank} case {case}: max difference {diff}"
        assert result["after"] == [float(world_size)] * 5
        assert "must be contiguous" in result["errors"]["noncontiguous"]
        assert "must be on this rank's device cpu" in result["errors"]["device"]
        assert "must be a torch.Tensor" in result["errors"]["type"]


@pytest.mark.parametrize("launched", [2, 3], indirect=True)
def test_ring_halves_equal_torchs_reduce_scatter_and_all_gather(launched):
    world_size, results = launched
    for rank, result in enumerate(r["halves"] for r in results):
        for shard in (1, 5, 2**18 + 1):
            rs_diff, ag_diff, input_kept = result[shard]
            assert rs_diff <= 1e-5 * world_size and ag_diff == 0.0 and input_kept, (rank, shard)
        assert "pad the flat buffer to a multiple of the world size" in result["size_error"]


@pytest.mark.parametrize("launched", [2, 3], indirect=True)
def test_a_64mb_ring_all_reduce_runs_one_batch_per_step(launched):
    world_size, results = launched
    total = world_size * (world_size + 1) / 2
    for rank, result in enumerate(r["halves"] for r in results):
        low, high, n_batches, batched, counted = result["big"]
        assert low == high == total, rank
        assert n_batches == 2 * (world_size - 1)
        # every byte this rank sent went through a batch: the ring's 2(N-1)/N of 64 MB
        assert batched == counted == pytest.approx(2 * (world_size - 1) / world_size * 64 * 2**20)
        # small tensor: each step is exactly one batch, one send right and one receive from the left
        assert len(result["batches"]) == 2 * (world_size - 1)
        for batch in result["batches"]:
            assert sorted(batch) == [("irecv", (rank - 1) % world_size, 10), ("isend", (rank + 1) % world_size, 10)]


@pytest.mark.parametrize("launched", [2, 3], indirect=True)  # the launches with gradients
def test_every_sync_method_gives_the_mean_gradient(launched):
    world_size, results = launched
    results = [r["gradients"] for r in results]
    names = results[0]["local"].keys()
    mean = {n: sum(r["local"][n] for r in results) / world_size for n in names}
    assert any(not torch.equal(results[0]["local"][n], results[1]["local"][n]) for n in names)
    for rank, result in enumerate(results):
        for method in ("naive", "bucketed", "bucketed-small-no-overlap", "bucketed-small-overlap", "ring", "ddp"):
            for n in names:
                torch.testing.assert_close(result[method][n], mean[n], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank}, {method}, grad of {n}")
    assert not math.isnan(mean["transformer.wte.weight"].sum().item())


# --- the benchmark -------------------------------------------------------------------------------

def test_allreduce_bench_table_from_known_times():
    from parallel_lib.bench.allreduce import Config, Results, markdown

    config = Config(sizes=(2**20, 4 * 2**20), repeats=1)
    results = Results(config, "test machine", "gloo", bandwidth=1e9, latency=1e-5, max_error=0.0,
                      seconds={"builtin": {2**20: 2e-3, 4 * 2**20: 4e-3}, "ring": {2**20: 4e-3, 4 * 2**20: 5e-3}})
    table = markdown(results)
    assert "2 gloo ranks on test machine" in table
    assert "| 1 MB | 2.000 | 0.52 | 0.52 | 4.000 | 0.26 | 0.26 | 0.50× | 1.069 |" in table  # 2^20/2e-3 B/s
    assert "worst 0.80×" in table and "B = 1.00 GB/s, α = 10.0 µs" in table


def test_allreduce_bench_quick_run_prints_its_table(capsys):
    from parallel_lib.bench.allreduce import main as bench_main
    from parallel_lib.runtime import machine_label

    assert bench_main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "| 1 KB |" in out and "| 32 KB |" in out and "| 1 MB |" in out
    assert machine_label() in out
    assert "Largest |ring_all_reduce - dist.all_reduce| over all sizes and ranks: 0." in out


# --- the animation replays the step record --------------------------------------------------------

def test_render_ring_outlines_the_chunks_each_step_delivers():
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from parallel_lib.viz.ring import frame_caption, render_ring

    for frame in range(5):
        fig = render_ring(3, frame)
        ax = fig.axes[0]
        arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
        outlines = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
        assert len(arrows) == (3 if frame else 0)  # one message per rank per step
        assert len(outlines) == 9 and sum(p.get_linewidth() > 1 for p in outlines) == (3 if frame else 0)
        plt.close(fig)
    assert frame_caption(3, 3).startswith("step 3/4, all-gather 1/2")
    with pytest.raises(ValueError, match="frame must be in 0..4"):
        render_ring(3, 5)


def test_ring_widget_follows_the_world_size_selector():
    from parallel_lib.viz.ring import ring_widget

    widget = ring_widget(world_size=3)
    size, play, frame = widget.children[0].children
    assert frame.max == play.max == 4
    frame.value = 2
    assert widget.children[1].value.startswith("step 2/4, reduce-scatter 2/2")
    size.value = 5
    assert frame.max == 8 and frame.value == 0


# --- a bucket's end time: when its sums are in the buffer on the device ---------------------------

def test_a_cpu_buckets_end_comes_from_the_completed_work(one_rank_group):
    import time

    from parallel_lib.common import TimelineRecorder

    # gloo completes the work's future when the sums are in the buffer: its callback dates the end,
    # not synchronize() when it looks later (the GPU path: tests/test_gpu_timeline.py)
    model = _tiny_gpt2()
    recorder = TimelineRecorder()
    with BucketedAllReduce(model, bucket_cap_mb=0.05, overlap=True, recorder=recorder) as sync:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
        time.sleep(0.05)
        looked = recorder.now()
        sync.synchronize()
    assert len(recorder.events) == len(sync.buckets) > 1
    assert all(e.end >= e.start for e in recorder.events)
    assert all(e.end < looked for e in recorder.events), "an end was stamped when synchronize() looked"
