"""Serving GPT-2 (chapter 09): a generation engine with a KV cache, and five ways to run it.

- :mod:`.kv_cache`: the preallocated per-layer K/V tensors and their census;
- :mod:`.batch`: requests, results, one group's plan (slots, positions, masks) and sampling;
- :mod:`.stage`: a piece of the one GPT-2 (its blocks, maybe split by heads) with the ends;
- :mod:`.engine`: prefill then decode over the stages of one process (single, mp);
- :mod:`.pipeline`: stages on ranks with several request groups in flight (pp);
- :mod:`.strategies`: single, dp, mp, pp and tp on ranks or devices, all giving the same tokens.
"""

from parallel_lib.inference.batch import Group, Request, Result, check_requests, sample
from parallel_lib.inference.engine import Engine, admit
from parallel_lib.inference.kv_cache import KVCache, kv_cache_bytes
from parallel_lib.inference.pipeline import generation_schedule, group_requests, run_pipeline_stage
from parallel_lib.inference.stage import Stage, build_stage
from parallel_lib.inference.strategies import (STRATEGIES, RankReport, ServeConfig, ServeRun, check_serve, serve,
                                              serve_many, serve_worker)

__all__ = ["Request", "Result", "Group", "check_requests", "sample", "Engine", "admit", "KVCache", "kv_cache_bytes",
           "Stage", "build_stage", "generation_schedule", "group_requests",
           "run_pipeline_stage", "STRATEGIES", "ServeConfig", "RankReport", "ServeRun", "check_serve", "serve",
           "serve_many", "serve_worker"]
