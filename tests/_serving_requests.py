"""The requests the serving tests share, and Hugging Face's greedy tokens for them (the reference)."""

import torch

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [40, 41, 42], list(range(20, 33))]
NEW = [7, 3, 9, 5, 12, 6]


def hf_greedy(model, prompts=PROMPTS, new=NEW) -> list[list[int]]:
    """Each prompt's next tokens from Hugging Face's greedy ``generate``, each request alone (no padding)."""
    out = []
    for p, n in zip(prompts, new):
        ids = torch.tensor([p])
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        out.append(got[0, len(p):].tolist())
    return out
