"""Serving GPT-2 the way vLLM does (chapter 13): paged KV cache, continuous batching, prefix caching.

- :mod:`.paged_kv_cache`: one pool of fixed-size blocks per layer, read through block tables;
- :mod:`.prefix_cache`: full blocks named by a hash chain, kept and evicted least recently used;
- :mod:`.block_manager`: block tables, reference counts, the free list;
- :mod:`.scheduler`: iteration-level batching with admission and preemption by recompute;
- :mod:`.engine`: the one GPT-2 run over them, step by step, with a record of every step;
- :mod:`.tensor_parallel_engine`: the engine on tp ranks, each with its heads of the weights and of the pool, and
  :mod:`.replicas`: N replica engines behind one router (both imported from their modules);
- :mod:`.waste`: KV slots held but unused, paged vs chapter 09's ``max_len`` reservation;
- :mod:`.trace`: a seeded Poisson request trace replayed through static and continuous batching;
- :mod:`.layout`: one step's batch over the block tables, flat or padded, built with tensor operations;
- :mod:`.speculative`: a draft model guesses k tokens, the target checks them in one pass (inside the engine);
- :mod:`.speculative_decoder`: speculative decoding of a list of requests in one call;
- :mod:`.frontend`: one engine thread stepping, many client threads submitting, a queue of updates each;
- :mod:`.completion_request`: what a completion request's body may hold, checked field by field;
- :mod:`.http`: ``POST /v1/completions`` in OpenAI's shape (streamed as server-sent events), on 127.0.0.1;
- :mod:`.load`: a load generator driving it as concurrent clients do (throughput, TTFT, TPOT);
- :mod:`.goodput`: requests per second that met a TTFT and a TPOT target;
- :mod:`.kv_transfer`: one sequence's KV blocks from one pool to another, in batched point-to-point messages;
- :mod:`.disaggregated`: prefill ranks and decode ranks, the blocks sent between them, against one engine.

The last seven are imported from their modules (``python -m parallel_lib.serving.http`` runs the server).
"""

from parallel_lib.serving.block_manager import BlockManager, blocks_for
from parallel_lib.serving.engine import ServingEngine, StepRecord
from parallel_lib.serving.layout import StepLayout, flat_is_cheaper, paged_forward, step_layout
from parallel_lib.serving.paged_kv_cache import PagedKVCache, PagedStep, slots_of
from parallel_lib.serving.prefix_cache import PrefixCache, block_hashes
from parallel_lib.serving.scheduler import Scheduled, Scheduler, Sequence
from parallel_lib.serving.speculative import (Drafter, SpeculativeSequence, SpeculativeStats, draft_from_target, draw,
                                              pick, probabilities, verify_token)
from parallel_lib.serving.speculative_decoder import SpeculativeDecoder
from parallel_lib.serving.trace import (Arrival, TraceMetrics, poisson_trace, replay_continuous, replay_static,
                                       trace_metrics)
from parallel_lib.serving.waste import KVWaste, kv_waste

__all__ = ["BlockManager", "blocks_for", "ServingEngine", "StepRecord", "PagedKVCache", "PagedStep", "slots_of",
           "PrefixCache", "block_hashes", "Scheduled", "Scheduler", "Sequence", "KVWaste", "kv_waste",
           "Arrival", "TraceMetrics", "poisson_trace", "replay_continuous", "replay_static", "trace_metrics",
           "StepLayout", "paged_forward", "step_layout", "flat_is_cheaper", "Drafter", "SpeculativeSequence",
           "SpeculativeDecoder", "SpeculativeStats", "draft_from_target", "draw", "pick", "probabilities", "verify_token"]
