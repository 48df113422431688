"""Chapter 09's benchmark and calculator against the engine: a census of its KV cache, and a smoke run.

The quick run is the only launch (two gloo ranks running every strategy in turn); the census
checks read its per-rank tensor counts, so one launch checks the calculator on every strategy.
"""

from __future__ import annotations

import pytest

from parallel_lib.bench.__main__ import main as bench_dispatch
from parallel_lib.bench._inference_runs import Measured
from parallel_lib.bench.inference import QUICK, Results, markdown, measure
from parallel_lib.inference import Engine, ServeConfig
from parallel_lib.inference.cost_model import Hardware
from parallel_lib.inference.serving_memory import kv_cache_bytes, weights_per_device


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_engine_kv_cache_census_equals_the_calculator(devices):
    config = ServeConfig(max_batch=3)
    engine = Engine.model_parallel(config.build(), list(range(devices)) if devices > 1 else ["cpu"], 3)
    model = config.config()
    slots = 3 * model.n_positions  # the engine preallocates max_batch rows of n_positions slots
    assert engine.kv_bytes() == kv_cache_bytes(model, slots, "fp32")
    share = kv_cache_bytes(model, slots, "fp32", layers=model.n_layer // devices)
    assert [c.nbytes() for c in engine.caches] == [share] * devices


def _measured(strategy, world, n, tpot, weights=1000, kv=2000):
    return Measured(strategy, world, n, 2 * tpot, tpot, n / tpot, weights, kv)


def test_table_from_known_runs():
    runs = {(s, w, n): _measured(s, w, n, 1e-3 * (1 + (s == "tp"))) for s, w in
            (("single", 1), ("dp", 2), ("mp", 2), ("pp", 2), ("tp", 2)) for n in (1, 2)}
    crossover = {("tiny", "single"): _measured("single", 1, 1, 1e-3), ("tiny", "tp"): _measured("tp", 2, 1, 2e-3)}
    hw = Hardware("test machine", 1e10, 1e10, 0.0, 1e9, 1e-4, 1e-4)
    table = markdown(Results(QUICK, "test machine", hw, runs, crossover))
    assert "on test machine" in table and "overhead 100 µs per layer" in table
    assert "| single | 1 | 1 | 2.00 (" in table and "| tp | 2 | 2 | 4.00 (" in table
    assert "- measured: tp = 2 first beats one device at none of these sizes" in table
    assert "ideally speed up inference by the number of available devices" in table
    assert "2 ranks: 1.00× one device's tokens/s at 1 request, 1.00× at 2" in table


def test_quick_run_measures_every_strategy_and_its_census(capsys):
    results = measure(QUICK)
    model = QUICK.serve_config().config()
    for n in QUICK.concurrency:  # caches sized to the work: a row per request, prompt + new tokens - 1 slots
        slots = min(n, QUICK.serve_config().max_batch) * (QUICK.prompt + QUICK.new_tokens - 1)
        run = {s: results.runs[(s, 1 if s == "single" else 2, n)] for s in ("single", "dp", "mp", "pp", "tp")}
        assert run["single"].kv_per_device == kv_cache_bytes(model, slots, "fp32")
        assert run["tp"].kv_per_device == kv_cache_bytes(model, slots, "fp32", tp=2)
        assert run["mp"].kv_per_device == kv_cache_bytes(model, slots, "fp32", layers=model.n_layer // 2)
        # the engine's tp ranks keep the whole embedding (no vocabulary split)
        assert run["tp"].weights_per_device == weights_per_device(model, "tp", 2, "fp32", vocab_parallel=False)[0]
        assert all(m.tokens_per_second > 0 and m.ttft > 0 for m in run.values())
    assert results.hardware.flops_per_second > 0 and results.hardware.link_latency >= 0
    with pytest.raises(SystemExit) as leaving:  # the dispatcher reaches the benchmark's own parser
        bench_dispatch(["inference", "--help"])
    assert leaving.value.code == 0 and "--quick" in capsys.readouterr().out


def test_latency_throughput_plot_draws_the_pareto_front_of_its_points():
    import matplotlib.pyplot as plt

    from parallel_lib.inference.cost_model import pareto_front
    from parallel_lib.viz.inference import calculator_figure, plot_latency_throughput
    points = [dict(strategy=s, ranks=2, concurrency=n, tpot=t, tokens_per_second=r)
              for s, n, t, r in (("dp", 1, 1e-3, 100.0), ("pp", 4, 2e-3, 400.0), ("tp", 1, 3e-3, 50.0))]
    fig = plot_latency_throughput(points)
    front = [line for line in fig.axes[0].lines if line.get_label() == "Pareto front (measured)"][0]
    assert list(front.get_xdata()) == [points[i]["tokens_per_second"] for i in pareto_front(
        [(p["tpot"], p["tokens_per_second"]) for p in points])] == [100.0, 400.0]
    assert len(calculator_figure("llama-2-70b", "L4 24GB (published)", "pp", 8, 4, 1024, 64).axes) == 3
    plt.close("all")
