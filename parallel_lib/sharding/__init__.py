"""Sharded data parallelism (chapter 06): flat-parameter shards, ZeRO-1/2/3, memory census::

    python -m parallel_lib.sharding --world-size 2 --stage 3
"""

from parallel_lib.sharding.flat import FlatParamGroup, make_buckets, padded_numel, shard_owner
from parallel_lib.sharding.layers import StageThreeHooks, layer_modules
from parallel_lib.sharding.zero import COLLECTIVES, PRECISIONS, STAGES, ZeroEngine

__all__ = [
    "padded_numel",
    "shard_owner",
    "make_buckets",
    "FlatParamGroup",
    "layer_modules",
    "StageThreeHooks",
    "STAGES",
    "COLLECTIVES",
    "PRECISIONS",
    "ZeroEngine",
]
