"""The course's cost model, in one place: what a layout holds and sends, as formulas.

Layer 0 (it imports only ``common`` and torch): the chapters, the training runs' checks and the
planner read the same formulas. Each is tested against the world, never against itself: a
literal from a paper (with its section), the tensor census of a real run, or the collective
counter of a real run.

- :mod:`.units`: the one convention: memory in GiB (2**30 bytes; a GPU's "80 GB" is binary), traffic
  and link speeds in GB (10**9 bytes).
- :mod:`.alpha_beta`: the time of one collective, ``hops·α + wire_bytes/β``, and its fit to measured
  times (chapter 02's all-reduce, the planner's calibration and chapter 11's ring share it).
- :mod:`.activation`: the activations a GPT block keeps for backward, Korthikanti et al. 2022's
  ``s·b·h·(34 + 5as/h)`` split by tensor and sequence parallelism, with full recomputation (chapters 03
  and 07 and the planner read it; the tensor census checks it byte for byte).
- :mod:`.kv_cache`: the KV cache's bytes, ``2 · layers · kv_heads · head_dim · tokens · bytes`` (chapters 03,
  09 and 13 and the serving calculator read it).
- :mod:`.zero`: ZeRO's model state per rank (ZeRO-3's gathered working set included, DeepSpeed's
  estimators beside it) and its traffic per step, micro-batches included.
- :mod:`.moe`: mixtures of experts: parameters (total, active; Mixtral 8x7B and DeepSeek-V3),
  model state per GPU with experts over ``ep``, the all-to-all bytes of expert parallelism.
"""

from parallel_lib.cost.activation import activation_bytes
from parallel_lib.cost.alpha_beta import (KINDS, AlphaBeta, allreduce_cost, fit_allreduce_cost,
                                          fit_alpha_beta, hops, ring_wire_bytes, wire_bytes)
from parallel_lib.cost.kv_cache import kv_bytes
from parallel_lib.cost.moe import (DEEPSEEK_V3, MIXTRAL_8X7B, EPTraffic, MoEShape, ep_traffic, gpt2_moe_shape,
                                   moe_memory, moe_step_traffic)
from parallel_lib.cost.units import GB, GiB, KiB, MiB
from parallel_lib.cost.zero import (
    BYTES_PER_PARAM,
    deepspeed_estimate,
    fsdp_shard_numel,
    megatron_bytes_per_param,
    zero_collectives,
    zero_memory,
    zero_paper_table,
    zero_passes,
    zero3_working_set,
    zero_traffic,
)

__all__ = ["activation_bytes", "KINDS", "AlphaBeta", "allreduce_cost", "fit_allreduce_cost", "fit_alpha_beta", "hops",
           "ring_wire_bytes", "wire_bytes", "kv_bytes", "KiB", "MiB", "GiB", "GB", "BYTES_PER_PARAM", "zero_memory", "zero_passes", "zero_traffic",
           "zero_collectives", "zero_paper_table", "megatron_bytes_per_param", "zero3_working_set",
           "deepspeed_estimate", "fsdp_shard_numel", "MoEShape", "MIXTRAL_8X7B", "DEEPSEEK_V3", "gpt2_moe_shape",
           "EPTraffic", "ep_traffic", "moe_memory", "moe_step_traffic"]
