"""A byte-level BPE tokenizer for the corpus, and the batches GPT-2 trains on.

* ``get_tokenizer``: a byte-level BPE trained in about a second on the pairs, with
  ``<pad>`` and ``<eos>``, as a transformers ``PreTrainedTokenizerFast``.
* ``collate_batch``: a pair becomes one sequence ``German <eos> English <eos>``; the
  shifted ``input_ids``/``labels`` and per-token weights make the loss count only the
  English tokens.

Example::

    train = load_corpus("train")
    tokenizer = get_tokenizer(train, vocab_size=2048)
    batch = collate_batch(train[:8], "de", "en", tokenizer, model_max_length=128)
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from parallel_lib.common.checks import check_int, positive_int
from parallel_lib.data.corpus import Example

__all__ = ["PAD_TOKEN", "EOS_TOKEN", "get_tokenizer", "collate_batch"]

PAD_TOKEN, EOS_TOKEN = "<pad>", "<eos>"
_MIN_VOCAB = 256 + 2  # the byte alphabet and the two special tokens


@lru_cache(maxsize=8)
def _train_bpe(texts: tuple[str, ...], vocab_size: int) -> str:
    # cached by content: every notebook cell and test that asks for the same tokenizer gets it at once
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer.to_str()


def get_tokenizer(examples: Sequence[Example], vocab_size: int = 2048, src_key: str = "de",
                  tgt_key: str = "en") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on both sides of ``examples``.

    Byte-level means any text encodes (no unknown token) and ``decode`` gives the text
    back. ``<pad>`` is id 0 and ``<eos>`` id 1; no token is added by ``encode`` itself.
    ``len(tokenizer)`` can be below ``vocab_size`` when the corpus has fewer merges to learn
    (the built-in corpus saturates near 4,800). Training is cached in memory by content.

    Args:
        examples: the training pairs (dicts with ``src_key`` and ``tgt_key``).
        vocab_size: the most tokens, special ones included; at least 258 (256 bytes + 2).
        src_key: key of the source text.
        tgt_key: key of the target text.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad_token_id`` and ``eos_token_id`` set;
        ``save_pretrained(dir)`` / ``PreTrainedTokenizerFast.from_pretrained(dir)`` round-trip.

    Raises:
        ValueError: no examples, or ``vocab_size`` below 258.
        KeyError: an example lacks ``src_key`` or ``tgt_key``.
    """
    check_int("vocab_size", vocab_size, minimum=_MIN_VOCAB, hint="256 bytes + pad + eos")
    if len(examples) == 0:
        raise ValueError("examples must hold at least one pair to train the tokenizer on, got none")
    texts = tuple(text for example in examples for text in (example[src_key], example[tgt_key]))
    tokenizer = Tokenizer.from_str(_train_bpe(texts, vocab_size))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)


def collate_batch(examples: Sequence[Example], src_key: str, tgt_key: str, tokenizer: PreTrainedTokenizerFast,
                  model_max_length: int, device: torch.device | str | None = None, *,
                  pad_to_max_length: bool = False) -> dict[str, torch.Tensor]:
    """Turn translation pairs into one right-padded, already shifted GPT-2 batch.

    Each pair becomes ``seq = src + [eos] + tgt + [eos]``, cut to ``model_max_length + 1``
    tokens (so that what remains fits the model after the shift), and then::

        input_ids[t] = seq[t]          labels[t] = seq[t + 1]
        label_token_weights[t] = 1     if labels[t] is a target token or the final eos,
                                 0     if it is a source token, the separating eos or padding

    so the first weighted position is the separating eos, where the model must produce
    the first English token. Padding (``pad_token_id`` in both ``input_ids`` and
    ``labels``) goes on the right, where causal attention keeps it from touching real
    tokens; the weights keep it out of the loss. A pair whose source alone fills
    ``model_max_length`` keeps no target token, and so has no weight.

    Args:
        examples: the pairs (dicts with ``src_key`` and ``tgt_key``), e.g. a DataLoader batch.
        src_key: key of the source text ("de").
        tgt_key: key of the target text ("en").
        tokenizer: from ``get_tokenizer`` (needs ``eos_token_id`` and ``pad_token_id``).
        model_max_length: the most positions per row (GPT-2's ``n_positions`` or fewer).
        device: where the tensors go (None: CPU).
        pad_to_max_length: pad every batch to ``model_max_length`` instead of its longest row,
            so that every step has the same shape (steadier timings, no re-compilation).

    Returns:
        ``{"input_ids": long (B, T), "labels": long (B, T), "label_token_weights": float (B, T)}``.

    Raises:
        ValueError: no examples, ``model_max_length`` below 1 or a tokenizer without pad/eos.
        TypeError: ``examples`` is not a list of pairs (e.g. a DataLoader batch that PyTorch's
            default collate already turned into ``{"de": [...], "en": [...]}``), or a text
            that is not a string (``None`` in loaded data).
    """
    _check_examples(examples, src_key, tgt_key)
    positive_int("model_max_length", model_max_length)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None or pad is None:
        raise ValueError(f"tokenizer needs eos and pad tokens (see get_tokenizer), got eos_token_id={eos}, "
                         f"pad_token_id={pad}")
    src = tokenizer([e[src_key] for e in examples], add_special_tokens=False)["input_ids"]
    tgt = tokenizer([e[tgt_key] for e in examples], add_special_tokens=False)["input_ids"]
    seqs = [(s + [eos] + t + [eos])[: model_max_length + 1] for s, t in zip(src, tgt)]
    width = model_max_length if pad_to_max_length else max(len(seq) for seq in seqs) - 1
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full((len(seqs), width), pad, dtype=torch.long)
    weights = torch.zeros((len(seqs), width), dtype=torch.float32)
    for row, (seq, s) in enumerate(zip(seqs, src)):
        n = len(seq) - 1  # positions of this row
        input_ids[row, :n] = torch.tensor(seq[:-1])
        labels[row, :n] = torch.tensor(seq[1:])
        weights[row, len(s):n] = 1.0  # labels from the first target token on (nothing if cut off)
    batch = {"input_ids": input_ids, "labels": labels, "label_token_weights": weights}
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def _check_examples(examples: Sequence[Example], src_key: str, tgt_key: str) -> None:
    if isinstance(examples, Mapping):  # what DataLoader's default collate makes of a list of pairs
        raise TypeError(f"examples must be a list of pairs, got one dict with keys {sorted(examples)}: a batch "
                        "that PyTorch's default collate already merged. Give the DataLoader "
                        "collate_fn=functools.partial(collate_batch, src_key=..., tgt_key=..., tokenizer=..., "
                        "model_max_length=...) instead of calling collate_batch on its batches")
    if len(examples) == 0:
        raise ValueError("examples must hold at least one pair, got an empty batch")
    for i, example in enumerate(examples):
        if not isinstance(example, Mapping):
            raise TypeError(f"examples must be a list of pairs (dicts with {src_key!r} and {tgt_key!r}), "
                            f"got examples[{i}]={example!r}")
        for key in (src_key, tgt_key):
            if not isinstance(example.get(key), str):
                raise TypeError(f"examples[{i}][{key!r}] must be a string, got {example.get(key)!r}; "
                                "drop or fix that pair (load_hf_translation refuses such rows)")
