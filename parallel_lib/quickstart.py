"""The smallest complete training run: corpus, tokenizer, tiny GPT-2, a few steps, one device.

Chapter 00 runs it to check that the whole stack works on the reader's machine before
any parallelism enters, and ``viz.setup`` draws its loss curve. Every piece is the one
the parallel chapters reuse, so this is also the single-device baseline in miniature.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.data import DataLoader

from parallel_lib.common.models import build_gpt2
from parallel_lib.common.training import TrainRecord, train
from parallel_lib.data.corpus import load_corpus
from parallel_lib.data.tokenizer import collate_batch, get_tokenizer

__all__ = ["tiny_run"]


def tiny_run(steps: int = 40, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
             device: torch.device | str | None = None, progress: bool = False) -> TrainRecord:
    """Train the "tiny" GPT-2 on German→English for ``steps`` batches on one device.

    Args:
        steps: optimizer steps (batches of the shuffled training split).
        batch_size: pairs per batch.
        lr: AdamW learning rate (high, because the run is short and the model tiny).
        seed: seeds the model's weights and the shuffle, so runs repeat exactly.
        device: where model and batches live (None: the CPU).
        progress: show train's tqdm bar with loss and tokens/s.

    Returns:
        The per-step ``TrainRecord`` (losses, target tokens, step times, tokens/s).
    """
    pairs = load_corpus("train")
    tokenizer = get_tokenizer(pairs, vocab_size=2048)
    model = build_gpt2("tiny", vocab_size=len(tokenizer), seed=seed).to(device or "cpu")
    collate = partial(collate_batch, src_key="de", tgt_key="en", tokenizer=tokenizer,
                      model_max_length=64)
    batches = DataLoader(pairs, batch_size=batch_size, shuffle=True, collate_fn=collate,
                         generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return train(model, optimizer, batches, desc="tiny GPT-2", device=device, progress=progress,
                 max_steps=steps)
