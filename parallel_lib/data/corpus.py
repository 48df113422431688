"""The German→English corpus the chapters train on, offline or from Hugging Face.

The chapters train a decoder-only GPT-2 on German→English translation, as the source
article does. ``load_corpus`` gives ~20,000 pairs built into the package (a seeded
grammar in ``_corpus_*.py``: real words, cases, verb-second and verb-final order,
questions, ...), so every notebook and test runs offline; ``load_hf_translation`` reads
a Hugging Face set (e.g. ``wmt14``/``de-en``) instead when the network and ``datasets``
are there. :mod:`parallel_lib.data.tokenizer` turns the pairs into GPT-2 batches.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import islice
from typing import Any

from parallel_lib.data._corpus_templates import generate_pairs

__all__ = ["SPLITS", "CORPUS_SEED", "Example", "load_corpus", "load_hf_translation"]

Example = dict[str, str]
SPLITS = {"train": 18_000, "validation": 1_000, "test": 1_000}  # split -> number of pairs, in this order
CORPUS_SEED = 2024  # the grammar's seed: changing it gives a different (equally valid) corpus


@lru_cache(maxsize=1)
def _corpus_pairs() -> tuple[tuple[str, str], ...]:
    # generated once per process (under a second), then served from memory
    return tuple(generate_pairs(sum(SPLITS.values()), CORPUS_SEED))


def load_corpus(split: str = "train", size: int | None = None) -> list[Example]:
    """The built-in German→English corpus: ``[{"de": ..., "en": ...}, ...]``.

    The splits are disjoint (no German sentence is in two of them) and identical in every
    process and on every machine. Each call returns fresh dicts, so callers may edit them.

    Args:
        split: "train" (18,000 pairs), "validation" (1,000) or "test" (1,000).
        size: keep only the first ``size`` pairs of the split (all when None).

    Raises:
        ValueError: unknown ``split``, or ``size`` negative or larger than the split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got split={split!r}")
    if size is not None and not 0 <= size <= SPLITS[split]:
        raise ValueError(f"size must be in 0..{SPLITS[split]} for split={split!r}, got size={size!r}")
    start = sum(SPLITS[s] for s in list(SPLITS)[: list(SPLITS).index(split)])
    stop = start + (SPLITS[split] if size is None else size)
    return [{"de": de, "en": en} for de, en in _corpus_pairs()[start:stop]]


def load_hf_translation(name: str, split: str = "train", config: str | None = None, src_key: str = "de",
                        tgt_key: str = "en", size: int | None = None, **kwargs: Any) -> list[Example]:
    """Pairs from a Hugging Face translation set, in ``load_corpus``'s format.

    Reads ``datasets.load_dataset(name, config, split=split, **kwargs)["translation"]``;
    needs the network (or the HF cache) and the optional ``datasets`` package.

    Args:
        name: the data set, e.g. "wmt14" or "opus_books".
        split: e.g. "train", "validation" or a slice such as "train[:20000]".
        config: the set's configuration, e.g. "de-en".
        src_key: language code of the source side, also the key in the returned dicts.
        tgt_key: language code of the target side.
        size: keep only the first ``size`` pairs.
        **kwargs: passed to ``datasets.load_dataset`` (cache_dir, revision, ...).

    Raises:
        ImportError: ``datasets`` is not installed.
        KeyError: a row lacks ``src_key`` or ``tgt_key``.
        ValueError: a row whose source or target is not a string (``None``).
    """
    try:
        import datasets  # optional, imported only here: the course runs without it
    except ImportError as err:
        raise ImportError("load_hf_translation needs the optional 'datasets' package; install it with "
                          "pip install -e '.[datasets]' (or use the offline load_corpus())") from err
    rows = datasets.load_dataset(name, config, split=split, **kwargs)["translation"]
    pairs = []
    for row in islice(rows, size):
        if src_key not in row or tgt_key not in row:
            raise KeyError(f"src_key={src_key!r} and tgt_key={tgt_key!r} must be keys of every translation, "
                           f"got a row with keys {sorted(row)}")
        bad = [key for key in (src_key, tgt_key) if not isinstance(row[key], str)]
        if bad:  # a None side would fail much later, inside the tokenizer, far from the row
            raise ValueError(f"row {len(pairs)} of {name!r} ({split}) has no text for {bad}: got {row!r}; "
                             "clean the set first (e.g. .filter on the translation column)")
        pairs.append({src_key: row[src_key], tgt_key: row[tgt_key]})
    return pairs
