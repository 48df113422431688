"""Tests for parallel_lib.check_gpu and the checks in parallel_lib.gpu_checks on a machine without a GPU.

The plan and the command line are pure and tested for 0, 1, 2 and 4 GPUs with a
faked ``torch.cuda.device_count``. The checks themselves use int device keys and
``launch``, which run on the CPU and gloo on a machine without GPUs (the CPU mode),
so their equivalence logic runs here for real on CPU "devices"; only the benchmarks
they end with (tested in test_bench_*.py) are replaced by fakes that record how they
were called. ``--allow-cpu`` runs the script itself that way.
"""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from parallel_lib import check_gpu, gpu_checks
from parallel_lib.check_gpu import NOTHING_CHECKED, Planned, format_plan, parse_args, plan
from parallel_lib.gpu_checks import CHECKS, QUICK, Check, CheckError, device_counts, register_check
from parallel_lib.gpu_checks import ch01_dp, ch02_allreduce, ch03_model_parallel, ch04_pipeline
from parallel_lib.gpu_checks._reference import max_difference
from parallel_lib.gpu_checks.ch00_setup import check_setup
from parallel_lib.gpu_checks.ch05_hybrid import check_hybrid, hybrid_grid


@pytest.mark.parametrize("n_devices, n_layers, expected", [
    (1, 12, [1]), (2, 12, [1, 2]), (3, 12, [1, 2, 3]), (4, 12, [1, 2, 4]), (6, 12, [1, 2, 4, 6]),
    (16, 12, [1, 2, 4, 8, 12]), (8, 4, [1, 2, 4]),
])
def test_device_counts_are_powers_of_two_and_all_devices(n_devices, n_layers, expected):
    assert device_counts(n_devices, n_layers) == expected


@pytest.mark.parametrize("n_gpus, expected", [
    (0, [("setup", 0, "needs >= 1 GPU, found 0"), ("dp", 0, "needs >= 2 GPUs, found 0"),
         ("allreduce", 0, "needs >= 2 GPUs, found 0"), ("model_parallel", 0, "needs >= 1 GPU, found 0"),
         ("pipeline", 0, "needs >= 2 GPUs, found 0"), ("hybrid", 0, "needs >= 2 GPUs, found 0"),
         ("sharding", 0, "needs >= 2 GPUs, found 0"),
         ("tensor_parallel", 0, "needs >= 2 GPUs, found 0"), ("schedules", 0, "needs >= 2 GPUs, found 0"),
         ("inference", 0, "needs >= 1 GPU, found 0"),
         ("grid3d", 0, "needs >= 2 GPUs, found 0"), ("context_parallel", 0, "needs >= 2 GPUs, found 0"),
         ("expert_parallel", 0, "needs >= 2 GPUs, found 0"), ("serving", 0, "needs >= 1 GPU, found 0")]),
    (1, [("setup", 1, ""), ("dp", 0, "needs >= 2 GPUs, found 1"), ("allreduce", 0, "needs >= 2 GPUs, found 1"),
         ("model_parallel", 1, ""), ("pipeline", 0, "needs >= 2 GPUs, found 1"),
         ("hybrid", 0, "needs >= 2 GPUs, found 1"), ("sharding", 0, "needs >= 2 GPUs, found 1"),
         ("tensor_parallel", 0, "needs >= 2 GPUs, found 1"), ("schedules", 0, "needs >= 2 GPUs, found 1"),
         ("inference", 1, ""), ("grid3d", 0, "needs >= 2 GPUs, found 1"),
         ("context_parallel", 0, "needs >= 2 GPUs, found 1"), ("expert_parallel", 0, "needs >= 2 GPUs, found 1"),
         ("serving", 1, "")]),
    (2, [("setup", 2, ""), ("dp", 2, ""), ("allreduce", 2, ""), ("model_parallel", 2, ""), ("pipeline", 2, ""),
         ("hybrid", 2, ""), ("sharding", 2, ""), ("tensor_parallel", 2, ""), ("schedules", 2, ""),
         ("inference", 2, ""), ("grid3d", 2, ""), ("context_parallel", 2, ""), ("expert_parallel", 2, ""),
         ("serving", 2, "")]),
    (4, [("setup", 4, ""), ("dp", 4, ""), ("allreduce", 4, ""), ("model_parallel", 4, ""), ("pipeline", 4, ""),
         ("hybrid", 4, ""), ("sharding", 4, ""), ("tensor_parallel", 4, ""), ("schedules", 4, ""),
         ("inference", 4, ""), ("grid3d", 4, ""), ("context_parallel", 4, ""), ("expert_parallel", 4, ""),
         ("serving", 4, "")]),
])
def test_plan_by_gpu_count(n_gpus, expected):
    assert plan(n_gpus) == [Planned(*row) for row in expected]


def test_plan_splits_the_model_over_at_most_one_gpu_per_layer():
    quick = {p.name: p.gpus for p in plan(8, quick=True)}  # the quick model has 4 layers
    full = {p.name: p.gpus for p in plan(16)}  # GPT-2 has 12

    assert quick == {"setup": 8, "hybrid": 8, "dp": 8, "allreduce": 8, "model_parallel": 4, "pipeline": 4, "sharding": 8,
                     "tensor_parallel": 8, "schedules": 4, "inference": 8,
                     "grid3d": 8, "context_parallel": 8, "expert_parallel": 8, "serving": 8}
    assert full == {"setup": 16, "hybrid": 16, "dp": 16, "allreduce": 16, "model_parallel": 12, "pipeline": 12, "sharding": 16,
                    "tensor_parallel": 16, "schedules": 12, "inference": 16,
                    "grid3d": 16, "context_parallel": 16, "expert_parallel": 16, "serving": 16}


def test_plan_only_and_its_table():
    planned = plan(2, only=["pipeline"])

    assert [p.name for p in planned if p.runs] == ["pipeline"]
    table = format_plan(planned).splitlines()
    assert table[:2] == ["| check | chapter | devices | what |", "|---|---|---:|---|"]
    assert "| dp | 01_data_parallel | - | skipped: not selected (--only) |" in table
    assert "| pipeline | 04_pipeline_parallel | 2 | Pipe over cuda:0..p-1: equivalence with one GPU, step times by m, " \
           "bench pp |" in table
    with pytest.raises(ValueError, match=r"only must name checks from \['setup', .*\], got \['gpu'\]"):
        plan(2, only=["gpu"])
    assert plan(1, kind="CPU device")[1].reason == "needs >= 2 CPU devices, found 1"


def test_the_registry_has_one_check_per_chapter_and_takes_new_ones(monkeypatch):
    assert [(name, c.chapter) for name, c in CHECKS.items()] == [
        ("setup", "00_setup_and_devices"), ("dp", "01_data_parallel"), ("allreduce", "02_all_reduce"),
        ("model_parallel", "03_model_parallel"),
        ("pipeline", "04_pipeline_parallel"), ("hybrid", "05_choosing_a_strategy"),
        ("sharding", "06_sharded_data_parallel"),
        ("tensor_parallel", "07_tensor_parallel"), ("schedules", "08b_v_shapes_and_hangs"), ("inference", "09_inference"),
        ("grid3d", "10_training_at_scale"), ("context_parallel", "11_long_context"),
        ("expert_parallel", "12_mixture_of_experts"), ("serving", "13_serving_engine")]
    monkeypatch.setattr(gpu_checks, "CHECKS", dict(CHECKS))
    register_check("zero", Check("06_sharding", 2, "ZeRO on NCCL ranks", lambda n, quick: "zero table"))
    assert [(p.name, p.gpus) for p in plan(4)][-1] == ("zero", 4)  # the next chapter: one line, then it runs
    with pytest.raises(ValueError, match="a check named 'dp' is already registered"):
        register_check("dp", gpu_checks.CHECKS["dp"])


def test_each_check_lives_in_the_module_named_by_its_chapter_and_name():
    modules = sorted(path.stem for path in Path(gpu_checks.__file__).parent.glob("ch*.py"))

    assert [check.run.__module__ for check in CHECKS.values()] == [
        f"parallel_lib.gpu_checks.ch{check.chapter[:2]}_{name}" for name, check in CHECKS.items()]
    assert modules == [f"ch{check.chapter[:2]}_{name}" for name, check in CHECKS.items()]  # none unregistered


def test_parse_args():
    defaults = parse_args([])
    args = parse_args(["--quick", "--only", "dp", "pipeline", "--gpus", "2", "--allow-cpu"])

    assert (defaults.quick, defaults.only, defaults.gpus, defaults.allow_cpu) == (False, None, None, False)
    assert (args.quick, args.only, args.gpus, args.allow_cpu) == (True, ["dp", "pipeline"], 2, True)


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--only", "tp"], "invalid choice: 'tp'"),
])
def test_parse_args_rejects(argv, message, capsys):
    with pytest.raises(SystemExit) as excinfo:
        parse_args(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


# --- main, with faked GPU counts and checks -------------------------------------------------------

@pytest.fixture
def fake_checks(monkeypatch):
    """Replace every check by one that records its call; "pipeline" raises. Returns the calls."""
    calls = []

    def fake(name):
        def check(n_gpus, quick):
            calls.append((name, n_gpus, quick))
            if name == "pipeline":
                raise CheckError("Pipe on 2 stages does not match one device")
            return f"table of {name}"
        return check

    for name, check in list(gpu_checks.CHECKS.items()):
        monkeypatch.setitem(gpu_checks.CHECKS, name, replace(check, run=fake(name)))
    monkeypatch.setattr(check_gpu, "environment_report", lambda: print("environment"))
    return calls


def test_main_without_gpu_says_so_checks_nothing_and_is_no_pass(monkeypatch, fake_checks, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    assert check_gpu.main(["--quick"]) == NOTHING_CHECKED != 0
    assert fake_checks == []
    out = capsys.readouterr().out
    assert out.startswith("No NVIDIA GPU found: ") and "so this is not a pass" in out and "--allow-cpu" in out


def test_main_allow_cpu_runs_every_check_on_cpu_devices_with_the_quick_sizes(monkeypatch, fake_checks, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    assert check_gpu.main(["--allow-cpu"]) == 1  # the fake pipeline check fails
    assert fake_checks == [("setup", 2, True), ("dp", 2, True), ("allreduce", 2, True),
                           ("model_parallel", 2, True), ("pipeline", 2, True), ("hybrid", 2, True), ("sharding", 2, True),
                           ("tensor_parallel", 2, True),
                           ("schedules", 2, True), ("inference", 2, True), ("grid3d", 2, True),
                           ("context_parallel", 2, True), ("expert_parallel", 2, True), ("serving", 2, True)]
    assert "## 01_data_parallel: dp on 2 CPU devices\n\ntable of dp" in capsys.readouterr().out
    fake_checks.clear()
    assert check_gpu.main(["--allow-cpu", "--gpus", "1"]) == 0
    assert fake_checks == [("setup", 1, True), ("model_parallel", 1, True), ("inference", 1, True),
                           ("serving", 1, True)]


def test_main_that_can_run_no_selected_check_is_no_pass(monkeypatch, fake_checks, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    assert check_gpu.main(["--only", "dp"]) == NOTHING_CHECKED
    assert fake_checks == []
    assert "No check can run on 1 GPU: nothing was checked, so this is not a pass." in capsys.readouterr().out


def test_main_runs_the_plan_and_reports_a_failed_check(monkeypatch, fake_checks, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    assert check_gpu.main(["--quick"]) == 1
    assert fake_checks == [("setup", 2, True), ("dp", 2, True), ("allreduce", 2, True),
                           ("model_parallel", 2, True), ("pipeline", 2, True), ("hybrid", 2, True), ("sharding", 2, True),
                           ("tensor_parallel", 2, True),
                           ("schedules", 2, True), ("inference", 2, True), ("grid3d", 2, True),
                           ("context_parallel", 2, True), ("expert_parallel", 2, True), ("serving", 2, True)]
    captured = capsys.readouterr()
    assert "## 03_model_parallel: model_parallel on 2 GPUs\n\ntable of model_parallel" in captured.out
    assert "CheckError: Pipe on 2 stages does not match one device" in captured.err  # and the others ran
    summary = captured.out.splitlines()[-18:-2]
    assert summary[:2] == ["| check | chapter | status | wall seconds |", "|---|---|---|---:|"]
    total = captured.out.splitlines()[-1]  # each chapter's wall time, and their sum
    seconds = [float(line.split(" | ")[-1].rstrip(" |")) for line in summary[2:]]
    assert total == f"total wall time of the checks: {sum(seconds):.1f} s on 2 GPUs"
    assert [line.split(" | ")[:3] for line in summary[2:]] == [
        ["| setup", "00_setup_and_devices", "passed"], ["| dp", "01_data_parallel", "passed"],
        ["| allreduce", "02_all_reduce", "passed"], ["| model_parallel", "03_model_parallel", "passed"],
        ["| pipeline", "04_pipeline_parallel", "FAILED"], ["| hybrid", "05_choosing_a_strategy", "passed"],
        ["| sharding", "06_sharded_data_parallel", "passed"],
        ["| tensor_parallel", "07_tensor_parallel", "passed"], ["| schedules", "08b_v_shapes_and_hangs", "passed"],
        ["| inference", "09_inference", "passed"],
        ["| grid3d", "10_training_at_scale", "passed"], ["| context_parallel", "11_long_context", "passed"],
        ["| expert_parallel", "12_mixture_of_experts", "passed"], ["| serving", "13_serving_engine", "passed"]]


def test_main_with_one_gpu_runs_the_checks_that_need_one(monkeypatch, fake_checks):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    assert check_gpu.main([]) == 0
    assert fake_checks == [("setup", 1, False), ("model_parallel", 1, False), ("inference", 1, False),
                           ("serving", 1, False)]


def test_main_uses_the_gpus_asked_for(monkeypatch, fake_checks, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    assert check_gpu.main(["--gpus", "2", "--only", "dp"]) == 0
    assert fake_checks == [("dp", 2, False)]
    assert check_gpu.main(["--gpus", "5"]) == 2
    assert "--gpus 5 asks for more GPUs than the 4 visible" in capsys.readouterr().err


@pytest.mark.parametrize("cuda, expected", [
    (None, "is a CPU-only build (install a CUDA build of torch)"),
    ("12.4", "is built with CUDA 12.4, but no GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"),
])
def test_no_gpu_message_names_the_cause(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert expected in check_gpu._no_gpu_message()


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU: the script checks it instead")
def test_smoke_run_on_the_cpu_as_ci_runs_it(capsys):
    # python -m parallel_lib.check_gpu --allow-cpu --only model_parallel, in this process (no start-up cost);
    # without --allow-cpu it exits NOTHING_CHECKED (test_main_without_gpu_...)
    assert check_gpu.main(["--allow-cpu", "--only", "model_parallel"]) == 0
    out = capsys.readouterr().out
    assert "## 03_model_parallel: model_parallel on 2 CPU devices" in out
    assert "| cpu, cpu | 2+2 | 0.0e+00 |" in out
    assert "| model_parallel | 03_model_parallel | passed |" in out


# --- the checks, on CPU "devices" -----------------------------------------------------------------

def test_max_difference_names_the_gradient_that_differs():
    expected = (torch.tensor(1.0), {"w": torch.zeros(3), "b": torch.zeros(2)})
    close = (torch.tensor(1.0), {"w": torch.full((3,), 1e-7), "b": torch.zeros(2)})
    wrong = (torch.tensor(1.0), {"w": torch.zeros(3), "b": torch.tensor([0.0, 1e-3])})

    assert max_difference(expected, close, "2 devices") == pytest.approx(1e-7)
    with pytest.raises(CheckError, match=r"2 devices does not match the reference: b: Tensor-likes are not close"):
        max_difference(expected, wrong, "2 devices")


def test_model_parallel_check_on_cpu_devices():
    table = ch03_model_parallel.check_model_parallel(2, quick=True)

    rows = [line for line in table.splitlines() if line.startswith("| cpu")]
    assert [row.split(" | ")[:2] for row in rows] == [["| cpu", "4"], ["| cpu, cpu", "2+2"]]
    assert all(row.split(" | ")[2] == "0.0e+00" for row in rows)  # same kernels on the CPU: exact
    assert "| devices | layers per device | max abs grad diff vs 1 device | target tokens/s | × 1 device |" in table


def test_pipeline_check_on_cpu_devices(monkeypatch):
    bench_configs, clocks = [], []
    monkeypatch.setattr(ch04_pipeline.bench_pp, "run", lambda config: bench_configs.append(config) or "results")
    monkeypatch.setattr(ch04_pipeline.bench_pp, "markdown", lambda results: f"pp table of {results}")

    class RecordedClock(ch04_pipeline.DeviceClock):
        def __init__(self, devices):
            super().__init__(devices)
            clocks.append([str(d) for d in self.devices])

    monkeypatch.setattr(ch04_pipeline, "DeviceClock", RecordedClock)

    text = ch04_pipeline.check_pipeline(4, quick=True)

    for devices in ("cpu, cpu", "cpu, cpu, cpu, cpu"):
        for schedule in ("gpipe", "1f1b"):
            assert f"| {devices} | {schedule} | " in text
    rows = [line.split(" | ")[:2] for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows == [[f"| {p}", str(m)] for p in (2, 4) for m in QUICK.micro_batches]
    assert text.endswith("pp table of results") and bench_configs == [ch04_pipeline.bench_pp.QUICK]
    # one clock per timed Pipe, waiting on the Pipe's own devices (here the CPU, named once)
    assert clocks == [["cpu"]] * (2 * len(QUICK.micro_batches))


def test_dp_check_on_gloo_ranks(monkeypatch):
    bench_configs = []
    monkeypatch.setattr(ch01_dp.bench_dp, "measure", lambda config: bench_configs.append(config) or "results")
    monkeypatch.setattr(ch01_dp.bench_dp, "markdown", lambda results: f"dp table of {results}")

    text = ch01_dp.check_dp(2, quick=True)

    for method in ("naive", "bucketed", "ring", "ddp"):
        assert f"| {method} | " in text and text.count(f"| {method} | ") == 1
    assert "Data parallel, 2 ranks on cpu .. cpu, 3 SGD steps" in text
    assert text.endswith("dp table of results")
    assert [(c.world_size, c.steps) for c in bench_configs] == [(2, ch01_dp.bench_dp.QUICK.steps)]


@pytest.mark.parametrize("max_error", [1e-6, 0.5, float("nan")])
def test_allreduce_check_fails_when_the_ring_disagrees(monkeypatch, max_error):
    configs = []

    def measure(config):
        configs.append(config)
        return types.SimpleNamespace(max_error=max_error)

    monkeypatch.setattr(ch02_allreduce.bench_allreduce, "measure", measure)
    monkeypatch.setattr(ch02_allreduce.bench_allreduce, "markdown", lambda results: "allreduce table")

    if max_error < 1e-3:
        assert ch02_allreduce.check_allreduce(4) == "allreduce table"
    else:
        with pytest.raises(CheckError, match="ring_all_reduce differs from dist.all_reduce"):
            ch02_allreduce.check_allreduce(4)
    assert [c.world_size for c in configs] == [4]


def test_part_one_checks_run_on_cpu_ranks():
    assert hybrid_grid(2) == [(1, 2), (2, 1)] and hybrid_grid(8) == [(2, 4), (4, 2), (8, 1)]
    assert "| tiny GPT-2, 10 steps | cpu | loss" in check_setup(2, quick=True)
    rows = [line.split(" | ") for line in check_hybrid(2, quick=True).splitlines() if line.startswith("| 1 x 2")
            or line.startswith("| 2 x 1")]
    assert [(r[0], r[1]) for r in rows] == [("| 1 x 2", "1f1b"), ("| 1 x 2", "gpipe"), ("| 2 x 1", "1f1b")]
    assert all(float(r[2]) < 1e-5 for r in rows)  # parameters as one process's


def test_context_parallel_check_on_cpu_ranks():
    """Chapter 11's check on 2 gloo ranks, quick: exactness, bytes and census vs the formulas, GPT-2, PyTorch's CP."""
    from parallel_lib.gpu_checks.ch11_context_parallel import check_context_parallel, cp_sizes

    assert cp_sizes(2) == [2] and cp_sizes(8) == [2, 4, 8] and cp_sizes(8, quick=True) == [8]
    table = check_context_parallel(2, quick=True)
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| 2 | ring") or
            line.startswith("| 2 | ulysses")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("ring", "contiguous", "no"), ("ring", "zigzag", "no"),
                                                  ("ring", "contiguous", "yes"), ("ring", "zigzag", "yes"),
                                                  ("ulysses", "contiguous", "yes"), ("ulysses", "zigzag", "yes")]
    assert all(float(r[4]) < 1e-5 and r[5] == "equal" for r in rows)
    assert rows[3][6] == "1.00 : 1 |" and rows[2][6] == "2.33 : 1 |"   # 448 : 192 entries
    # (tiles of 8, chunks of 8: contiguous rank 0 computes 3 tiles of its own block, rank 1 3 + 4; zig-zag 5 and 5)
    # on a CPU PyTorch's context parallelism refuses, and the check says why
    assert "| refused: NotImplementedError: " in table and "_scaled_dot_product_flash_attention_for_cpu" in table
    beside = next(line for line in table.splitlines() if "| refused: " in line).split(" | ")
    assert float(beside[2]) < 1e-5, beside   # our zig-zag ring on PyTorch's inputs, against SDPA
    # the census: b·n·(s/cp)·(d + 1)·4 bytes for the ring, b·(n/cp)·s·(4d + 1)·4 + 8·s for Ulysses
    for row in ("| ring | contiguous | 2 | 32 | 2.2 |", "| ring | zigzag | 2 | 32 | 2.2 |",
                "| ulysses | contiguous | 2 | 32 | 8.5 |"):
        assert row in table, row


def test_the_context_parallel_check_compares_pytorch_with_ours_where_it_runs():
    """The GPU branch, from made-up findings: PyTorch's output is compared with SDPA's and with our ring's."""
    from parallel_lib.gpu_checks._reference import CheckError
    from parallel_lib.gpu_checks.ch11_context_parallel import pytorch_beside_ours

    ran = {"ours": 2e-7, "ran": True, "output": 3e-7, "beside_ours": 4e-7}
    assert pytorch_beside_ours(4, 1e-6, [ran, dict(ran, output=5e-7)]) == [
        4, "1.0e-06", "2.0e-07", "ran: 5.0e-07 from SDPA, 4.0e-07 from ours"]
    refused = {"ours": 1e-7, "ran": False, "error": "NotImplementedError: no rule"}
    assert pytorch_beside_ours(2, 0.0, [refused])[3] == "refused: NotImplementedError: no rule"
    for bad, match in ((dict(ran, beside_ours=1e-2), "from our ring attention by 0.01"),
                       (dict(ran, output=float("nan")), "differs from SDPA by nan"),
                       (dict(refused, ours=1e-2), "our ring attention \\(zig-zag\\) at cp=2 differs from SDPA")):
        with pytest.raises(CheckError, match=match):
            pytorch_beside_ours(2, 0.0, [ran, bad])


def test_serving_check_on_the_cpu_compares_every_engine_with_hugging_face_and_times_by_device_events(monkeypatch):
    """Chapter 13's check, quick, on the CPU: the engine's tokens vs Hugging Face's on the same device, timed by
    a recorder of that device (CUDA events on a GPU) and never by synchronising; a wrong token fails it."""
    from parallel_lib.gpu_checks import ch13_serving

    recorders = []

    class Recorded(ch13_serving.TimelineRecorder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            recorders.append(self)

    def no_synchronize(*args, **kwargs):
        raise AssertionError("the serving check must not synchronise the device to take a time")

    monkeypatch.setattr(ch13_serving, "TimelineRecorder", Recorded)
    monkeypatch.setattr(torch.cuda, "synchronize", no_synchronize)
    table = ch13_serving.check_serving(1, quick=True)

    assert [r.device for r in recorders] == [torch.device("cpu")]       # the model's device: events on a GPU
    assert [e.lane for e in recorders[0].events] == ["hf", "continuous batching",
                                                     "+ chunked prefill (16 tokens/step)",
                                                     "+ speculative decoding (k=4, draft: first layer)"]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| continuous", "| +"))]
    assert [(r[0], r[1]) for r in rows] == [("| continuous batching", "12/12"),
                                            ("| + chunked prefill (16 tokens/step)", "12/12"),
                                            ("| + speculative decoding (k=4, draft: first layer)", "12/12")]
    assert "on cpu: 12 greedy requests" in table
    # an engine that gets one token wrong fails the check, naming the request
    run = ch13_serving.ServingEngine.run

    def off_by_one(engine, requests):
        results = run(engine, requests)
        results[3].tokens[-1] = (results[3].tokens[-1] + 1) % 97
        return results

    monkeypatch.setattr(ch13_serving.ServingEngine, "run", off_by_one)
    with pytest.raises(CheckError, match="continuous batching on cpu: 1 of 12 requests got other tokens than "
                                         "Hugging Face generate, e.g. request 3"):
        ch13_serving.check_serving(1, quick=True)
    # without a GPU and without --allow-cpu nothing is checked, and that is no pass
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert check_gpu.main(["--only", "serving"]) == NOTHING_CHECKED
