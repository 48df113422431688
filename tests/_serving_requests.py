"""The requests the serving tests share, and Hugging Face's greedy tokens for them (the reference)."""

import torch

from parallel_lib.serving.walkthrough import NEW, PROMPTS  # chapter 13's walkthrough serves the same requests


def hf_greedy(model, prompts=PROMPTS, new=NEW) -> list[list[int]]:
    """Each prompt's next tokens from Hugging Face's greedy ``generate``, each request alone (no padding)."""
    out = []
    for p, n in zip(prompts, new):
        ids = torch.tensor([p])
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        out.append(got[0, len(p):].tolist())
    return out
