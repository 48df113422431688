"""Smoke run of ``python -m parallel_lib.bench pp --quick``: it runs every variant and prints the table."""

from parallel_lib.bench import pp
from parallel_lib.bench.__main__ import main as bench_main


def test_quick_pipeline_benchmark_prints_every_runner(capsys):
    assert bench_main(["pp", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### Pipeline parallelism, 2 stages — ")
    for label in pp.RUNNERS.values():
        assert f"| {label} | " in out
    assert "| ideal p·m/(m+p−1) | 1.00× | 1.33× | 1.60× |" in out
    assert "2 processes" in out and "Target: Pipe GPipe at its best m=" in out
    assert "n/a" in out  # torch's Schedule1F1B refuses fewer micro-batches than stages


def test_markdown_reports_the_target_and_which_kind_of_worker_wins():
    config = pp.Config(micro_batches=(1, 4))
    results = pp.Results(config, "test machine", ["cpu", "cpu"], plain=1.0, thread_ceiling=1.5, process_ceiling=1.9,
                         plain_processes=1.0,
                         steps={"gpipe": {1: 1.0, 4: 0.8}, "1f1b": {1: 1.0, 4: 0.8},
                                "torch-gpipe": {1: 1.0, 4: 0.6}, "torch-1f1b": {4: 0.6}})
    text = pp.markdown(results)
    assert "| Pipe, GPipe (threads) | 1000 ms · 1.00× | 800 ms · 1.25× |" in text
    assert "at its best m=4 reaches 1.25×; 0.85 × min(ideal 1.60×, thread ceiling 1.50×) = 1.27× — NOT met" in text
    assert "Processes win here" in text and "1.90× in two processes but 1.50× in two threads" in text
    assert "Warning" not in text
    results.thread_ceiling = 1.05
    assert "Warning: two threads with no dependencies ran only 1.05× as fast as one" in pp.markdown(results)
