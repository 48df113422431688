"""Sharded data parallelism (chapter 06): flat-parameter shards, ZeRO-1/2/3, memory census, checkpoints.

Runs train through the one training entry (``parallel_lib.training``: ``Plan(dp=N, zero=S)``;
its ``zero_measure`` holds the chapter's measurements)::

    python -m parallel_lib.sharding --world-size 2 --stage 3
"""

from parallel_lib.sharding.flat import FlatParamGroup, padded_numel, shard_owner
from parallel_lib.sharding.grouping import FlatGroups, flat_groups
from parallel_lib.sharding.checkpoint import consolidate, load_full, load_shards, save_shards, shard_state
from parallel_lib.sharding.layers import StageThreeHooks, layer_modules, mean_durations, simulate_zero3, step_events
from parallel_lib.sharding.memory import (
    BYTES_PER_PARAM,
    engine_census,
    megatron_bytes_per_param,
    storage_census,
    zero_memory,
    zero_paper_table,
    zero_traffic,
)
from parallel_lib.sharding.zero import COLLECTIVES, PRECISIONS, STAGES, ZeroEngine

__all__ = [
    "padded_numel",
    "shard_owner",
    "FlatParamGroup",
    "FlatGroups",
    "flat_groups",
    "layer_modules",
    "StageThreeHooks",
    "simulate_zero3",
    "step_events",
    "mean_durations",
    "BYTES_PER_PARAM",
    "storage_census",
    "engine_census",
    "zero_memory",
    "zero_traffic",
    "zero_paper_table",
    "megatron_bytes_per_param",
    "shard_state",
    "save_shards",
    "load_shards",
    "consolidate",
    "load_full",
    "STAGES",
    "COLLECTIVES",
    "PRECISIONS",
    "ZeroEngine",
]
