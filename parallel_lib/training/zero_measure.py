"""Chapter 06's two measurements through the one training entry, one call each, for the notebook and
``parallel_lib.figures``:

- :func:`measure_stages`: ZeRO-0..3 on tiny GPT-2 (``Plan(dp=N, zero=s)``), rank 0's census and
  counted bytes beside the formulas;
- :func:`zero3_timelines`: ZeRO-3's all-gather / compute / free per layer, measured without and
  with prefetch (``RunConfig.timeline_steps``: the engine's events), each beside
  :func:`~parallel_lib.sharding.layers.simulate_zero3` fed with the measured mean durations.

Chapter 06's runs are data parallel only, with one micro-batch per step (:func:`zero_plan`): a
second micro-batch would gather ZeRO-3's layers a second time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from parallel_lib.common.timeline import Event
from parallel_lib.runtime.launcher import launch
from parallel_lib.sharding.layers import mean_durations, simulate_zero3, step_events
from parallel_lib.sharding.memory import zero_memory, zero_traffic
from parallel_lib.training.layouts import train_layout
from parallel_lib.training.plan import Plan
from parallel_lib.training.run import RunConfig, train_many

__all__ = ["STAGE_RUN", "zero_plan", "engine_events", "measure_stages", "zero3_timelines"]

STAGE_RUN = RunConfig(model="tiny", vocab_size=512, batch_size=8, seq_len=32, steps=2, precision="bf16",
                      return_state=False)


def zero_plan(world_size: int, stage: int = 0, sync: str = "zero") -> Plan:
    """Data parallelism over ``world_size`` ranks at ZeRO ``stage`` (or PyTorch's ``sync``), one micro-batch a step."""
    return Plan(dp=world_size, zero=stage, sync=sync, micro_batches=1)


def engine_events(events: Sequence[Event]) -> list[Event]:
    """ZeRO's engine's events of a run's timeline (its "rank R comm" and "rank R compute" lanes)."""
    return [e for e in events if e.lane.endswith((" comm", " compute"))]


def measure_stages(world_size: int = 2, run: RunConfig = STAGE_RUN) -> tuple[dict, dict, dict, dict]:
    """``(census, formula, sent, expected)`` of rank 0 per stage name ("ZeRO-0" .. "ZeRO-3"), in bytes."""
    names = [f"ZeRO-{s}" for s in range(4)]
    results = dict(zip(names, launch(train_many, world_size, [(zero_plan(world_size, s), run) for s in range(4)],
                                     timeout=600)[0]))
    census = {name: r.census for name, r in results.items()}
    formula = {name: zero_memory(r.trainable_parameters, world_size, r.plan.zero, run.precision)
               for name, r in results.items()}
    sent = {name: r.wire_bytes for name, r in results.items()}
    expected = {name: zero_traffic(r.trainable_parameters, world_size, r.plan.zero, run.precision)
                for name, r in results.items()}
    return census, formula, sent, expected


def zero3_timelines(world_size: int = 2, run: RunConfig = STAGE_RUN) -> dict[str, list[Event]]:
    """Rank 0's last step of ZeRO-3, measured and simulated, without and with prefetch."""
    out: dict[str, list[Event]] = {}
    for prefetch in (False, True):
        traced = replace(run, prefetch=prefetch, steps=3, timeline_steps=3, precision="fp32")
        result = train_layout(zero_plan(world_size, 3), traced, timeout=600)[0]
        events = step_events(engine_events(result.events), traced.steps - 1)
        t0 = min(e.start for e in events)
        events = [Event(e.lane, e.kind, e.micro_batch, e.start - t0, e.end - t0, e.label) for e in events]
        n_layers = len({e.label for e in events if e.kind == "forward"})
        word = "with" if prefetch else "without"
        out[f"measured, {word} prefetch"] = events
        out[f"simulated, {word} prefetch"] = simulate_zero3(n_layers, prefetch=prefetch, **mean_durations(events))
    return out
