"""Context parallelism (chapter 11): one long sequence split over the ``cp`` ranks of the mesh.

- :mod:`.tiled`: attention in tiles, a running maximum and sum (FlashAttention's idea), no s² tensor kept;
- :mod:`.layout`: which tokens a rank holds, the contiguous and the zig-zag split (causal load balance);
- :mod:`.ring`: ring attention, key/value blocks passed round the ring, merged by log-sum-exp;
- :mod:`.ulysses`: DeepSpeed Ulysses, sequence shards swapped for head shards by all-to-all;
- :mod:`.parallelize`: ``parallelize_cp``, the one GPT-2 with its attention swapped for ring attention;
- :mod:`.cost`: bytes on the wire per rank, bytes attention keeps for backward, when a ring step hides its transfer;
- :mod:`.verify`: exactness checks that run inside ranks (ring and Ulysses against full attention);
- :mod:`.measure`: memory per rank (census), time, work and bytes against sequence length; a ring step timed apart.

Beside PyTorch: ``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13) does not run
on a CPU. It shards the buffers, then reaches attention through SDPA's DTensor dispatch, which has
sharding rules for the CUDA kernels (flash, memory-efficient, cuDNN) only; the CPU's
``aten._scaled_dot_product_flash_attention_for_cpu`` has none, so it raises ``NotImplementedError``
(pinned by a test). On GPUs ``python -m parallel_lib.check_gpu --only context_parallel`` runs it and
our ring on the same inputs and compares each with SDPA and with the other
(:func:`.verify.torch_context_parallel_check`).
"""

from parallel_lib.context_parallel.cost import (METHODS, RingStepTime, WireBytes, attention_saved_bytes, cp_wire_bytes,
                                               hiding_seq_len, ring_step_flops, ring_step_time)
from parallel_lib.context_parallel.layout import LAYOUTS, chunk_ids, gather_sequence, shard_positions, shard_sequence
from parallel_lib.context_parallel.parallelize import CPInfo, RingSelfAttention, cp_shard, parallelize_cp
from parallel_lib.context_parallel.ring import RingEvent, cp_group_of, merge_partials, ring_attention
from parallel_lib.context_parallel.tiled import (TileWork, full_attention, saved_attention_bytes, tiled_attention,
                                                 tiled_backward, tiled_forward)
from parallel_lib.context_parallel.ulysses import check_ulysses, heads_to_seq, seq_to_heads, ulysses_attention

__all__ = [
    "TileWork", "full_attention", "tiled_attention", "tiled_forward", "tiled_backward", "saved_attention_bytes",
    "LAYOUTS", "chunk_ids", "shard_positions", "shard_sequence", "gather_sequence",
    "RingEvent", "cp_group_of", "merge_partials", "ring_attention",
    "check_ulysses", "seq_to_heads", "heads_to_seq", "ulysses_attention",
    "CPInfo", "RingSelfAttention", "parallelize_cp", "cp_shard",
    "METHODS", "WireBytes", "cp_wire_bytes", "attention_saved_bytes", "ring_step_flops", "RingStepTime",
    "ring_step_time", "hiding_seq_len",
]
