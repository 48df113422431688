"""The chapter's two measurements in one call each, for the notebook and ``parallel_lib.figures``.

- :func:`measure_stages`: ZeRO-0..3 on tiny GPT-2, the rank-0 census and counted bytes beside the formulas;
- :func:`zero3_timelines`: ZeRO-3's all-gather / compute / free per layer, measured without and
  with prefetch, each beside :func:`~parallel_lib.sharding.layers.simulate_zero3` fed with the
  measured mean durations.
"""

from __future__ import annotations

from dataclasses import replace

from parallel_lib.common.timeline import Event
from parallel_lib.runtime.launcher import launch
from parallel_lib.sharding.layers import mean_durations, simulate_zero3, step_events
from parallel_lib.sharding.memory import zero_memory, zero_traffic
from parallel_lib.sharding.train import ShardConfig, ShardResult, run_sharded

__all__ = ["STAGE_RUN", "run_many", "measure_stages", "zero3_timelines"]

STAGE_RUN = ShardConfig(model="tiny", vocab_size=512, batch_size=8, seq_len=32, steps=2, precision="bf16",
                        return_state=False)


def run_many(rank: int, world_size: int, configs: dict[str, ShardConfig]) -> dict[str, ShardResult]:
    """:func:`~parallel_lib.sharding.train.run_sharded` for each config in turn, in one launch."""
    return {name: run_sharded(rank, world_size, config) for name, config in configs.items()}


def measure_stages(world_size: int = 2, config: ShardConfig = STAGE_RUN) -> tuple[dict, dict, dict, dict]:
    """``(census, formula, sent, expected)`` of rank 0 per stage name ("ZeRO-0" .. "ZeRO-3"), in bytes."""
    configs = {f"ZeRO-{s}": replace(config, stage=s) for s in range(4)}
    results = launch(run_many, world_size, configs, timeout=600)[0]
    census = {name: r.census for name, r in results.items()}
    formula = {name: zero_memory(r.num_params, world_size, r.config.stage, r.config.precision)
               for name, r in results.items()}
    sent = {name: r.wire_bytes for name, r in results.items()}
    expected = {name: zero_traffic(r.num_params, world_size, r.config.stage, r.config.precision)
                for name, r in results.items()}
    return census, formula, sent, expected


def zero3_timelines(world_size: int = 2, config: ShardConfig = STAGE_RUN) -> dict[str, list[Event]]:
    """Rank 0's last step of ZeRO-3, measured and simulated, without and with prefetch."""
    out: dict[str, list[Event]] = {}
    for prefetch in (False, True):
        run = replace(config, stage=3, prefetch=prefetch, timeline=True, steps=3, precision="fp32")
        events = step_events(launch(run_sharded, world_size, run, timeout=600)[0].events, run.steps - 1)
        t0 = min(e.start for e in events)
        events = [Event(e.lane, e.kind, e.micro_batch, e.start - t0, e.end - t0, e.label) for e in events]
        n_layers = len({e.label for e in events if e.kind == "forward"})
        word = "with" if prefetch else "without"
        out[f"measured, {word} prefetch"] = events
        out[f"simulated, {word} prefetch"] = simulate_zero3(n_layers, prefetch=prefetch, **mean_durations(events))
    return out
