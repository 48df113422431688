"""The one batch source: every process (each rank of every layout, and the reference) builds the
same global batches from the run and takes its rows of them.

Two sources (``RunConfig.data``):

- ``"synthetic"``: random token ids, some rows right-padded (their padded positions carry no
  loss weight); what the equivalence proofs train on. The rows do not depend on ``dp``.
- ``"corpus"``: the course's German→English pairs (chapter 00's data), tokenised by the
  course's BPE tokenizer and padded to ``seq_len`` positions (the same shape every step: steady
  timings, exact byte counts). Global batch ``k`` is what ``dp`` replicas that each load their
  part with chapter 01's ``partition_dataset`` train on in step ``k``, in replica order
  (:func:`~parallel_lib.data.partition.global_batch_indices`): replica ``d``'s rows of it are
  exactly its ``partition_dataset`` batch. A new shuffle per epoch, as ``set_epoch`` gives.

A replica takes rows ``d`` of ``dp`` equal chunks of each global batch (:func:`replica_rows`).
"""

from __future__ import annotations

from functools import partial

import torch

from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.partition import global_batch_indices
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer
from parallel_lib.tensor_parallel.batches import TPConfig, make_batches

__all__ = ["DATA_SOURCES", "global_batches", "replica_rows"]

DATA_SOURCES = ("synthetic", "corpus")

Batch = dict[str, torch.Tensor]


def global_batches(run, dp: int = 1) -> list[Batch]:  # type: ignore[no-untyped-def]  # a RunConfig (run.py imports this)
    """The run's ``run.steps`` global batches of ``run.batch_size`` rows, the same in every process.

    Args:
        run: the :class:`~parallel_lib.training.run.RunConfig`.
        dp: the replicas the rows are for (the corpus source's order depends on it; the
            synthetic one does not).

    Returns:
        Per step a dict of ``input_ids``, ``labels`` and ``label_token_weights``, each
        ``(batch_size, seq_len)`` (synthetic rows also carry their ``attention_mask``).
    """
    if run.data == "synthetic":
        return make_batches(TPConfig(model=run.model, vocab_size=run.vocab_size, batch_size=run.batch_size,
                                     seq_len=run.seq_len, steps=run.steps, seed=run.seed, padding=run.padding))
    return _corpus_batches(run, dp)


def _corpus_batches(run, dp: int) -> list[Batch]:  # type: ignore[no-untyped-def]
    pairs = load_corpus("train", size=run.train_examples)
    tokenizer = get_tokenizer(pairs, vocab_size=run.vocab_size)
    if len(tokenizer) > run.vocab_size:  # the tokenizer never exceeds what it is asked for; a guard for the model
        raise ValueError(f"the corpus tokenizer has {len(tokenizer)} tokens, more than vocab_size={run.vocab_size}")
    collate = partial(collate_batch, src_key="de", tgt_key="en", tokenizer=tokenizer, model_max_length=run.seq_len,
                      pad_to_max_length=True)
    batches: list[Batch] = []
    epoch = 0
    while len(batches) < run.steps:
        for indices in global_batch_indices(len(pairs), dp, run.batch_size, seed=run.data_seed, epoch=epoch):
            if len(batches) == run.steps:
                break
            batch = collate([pairs[i] for i in indices])
            batches.append(batch)
        epoch += 1
    return batches


def replica_rows(batch: Batch, d: int, dp: int) -> Batch:
    """Replica ``d``'s rows of a global batch: chunk ``d`` of ``dp`` equal ones."""
    return {k: v.chunk(dp)[d] for k, v in batch.items()}
