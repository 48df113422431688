"""Data for every chapter: partitioning a data set over ranks, the offline German→English
corpus (its grammar kept apart as data in ``_corpus_*.py``), the tokenizer and batches.
"""

from parallel_lib.data.corpus import CORPUS_SEED, SPLITS, Example, load_corpus, load_hf_translation
from parallel_lib.data.partition import (
    DataPartitioner,
    Partition,
    PartitionSampler,
    check_global_batch,
    global_batch_indices,
    partition_dataset,
    partition_lengths,
)
from parallel_lib.data.tokenizer import EOS_TOKEN, PAD_TOKEN, collate_batch, get_tokenizer

__all__ = [
    "SPLITS",
    "CORPUS_SEED",
    "Example",
    "load_corpus",
    "load_hf_translation",
    "Partition",
    "DataPartitioner",
    "PartitionSampler",
    "partition_lengths",
    "partition_dataset",
    "global_batch_indices",
    "check_global_batch",
    "PAD_TOKEN",
    "EOS_TOKEN",
    "get_tokenizer",
    "collate_batch",
]
