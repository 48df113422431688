"""Tensor parallelism (chapter 07): Megatron's column and row layers from all-reduce, GPT-2 split by heads.

- :mod:`.regions`: the conjugate operators ``f``/``g`` and the sequence-parallel gather / reduce-scatter;
- :mod:`.layers`: ``ColumnParallelLinear``, ``RowParallelLinear`` (from a dense layer, and back);
- :mod:`.vocab`: the vocabulary-parallel embedding and cross-entropy;
- :mod:`.sequence`: what sequence parallelism adds (the positions of my tokens, the partial gradients);
- :mod:`.parallelize`: ``parallelize_tp``, the parts above swapped into the one GPT-2 (:mod:`parallel_lib.models`);
- :mod:`.convert`: ``tensor_parallelize`` (a copy of a dense GPT-2, split) and ``gather_dense`` (back);
- :mod:`.batches`, :mod:`.verify`: the chapter's run settings and batches, exactness checks inside ranks
  (training itself is a plan of :func:`parallel_lib.training.train`);
- :mod:`.cost`: collectives, bytes and time per step; :mod:`.dtensor`: PyTorch's DTensor beside it.
"""

from parallel_lib.tensor_parallel.convert import gather_dense, tensor_parallelize
from parallel_lib.cost.shape import GPTShape
from parallel_lib.tensor_parallel.cost import layer_collectives, step_collectives
from parallel_lib.tensor_parallel.parallelize import TPInfo, check_tp_split, parallelize_tp, tp_group_of
from parallel_lib.tensor_parallel.sequence import sync_sequence_parallel_grads
from parallel_lib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel_lib.tensor_parallel.regions import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    record_regions,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    sequence_parallel_linear,
)
from parallel_lib.tensor_parallel.split import naive_qkv_rows, qkv_rows
from parallel_lib.tensor_parallel.batches import TPConfig, make_batches
from parallel_lib.tensor_parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_parallel_cross_entropy

__all__ = [
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "sequence_parallel_linear", "record_regions",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
    "vocab_parallel_cross_entropy", "qkv_rows", "naive_qkv_rows", "sync_sequence_parallel_grads",
    "parallelize_tp", "tp_group_of", "check_tp_split", "TPInfo", "tensor_parallelize", "gather_dense",
    "TPConfig", "make_batches", "GPTShape", "layer_collectives", "step_collectives",
]
