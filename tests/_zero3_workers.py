"""The worker of tests/test_cost_zero.py's ZeRO-3 working-set check, run inside ranks that ``launch`` spawns.

It trains tiny GPT-2 with :class:`~parallel_lib.sharding.zero.ZeroEngine` at stage 3 and takes the
tensor census (:func:`~parallel_lib.sharding.memory.engine_census`) at every point of the second
step where the working set can peak: each block's MLP in the forward (its group gathered, the next
one prefetched) and in the backward, and each group's reduce-scatter launch (its gradients whole).
"""

from __future__ import annotations

import torch

from parallel_lib.common.models import build_gpt2
from parallel_lib.sharding.memory import engine_census, storage_census
from parallel_lib.sharding.zero import ZeroEngine


def zero3_peak_censuses(rank: int, world_size: int, prefetches: tuple = (False, True), **shape: int) -> list[dict]:
    """:func:`zero3_peak_census` for each prefetch setting, in one launch."""
    return [zero3_peak_census(rank, world_size, prefetch, **shape) for prefetch in prefetches]


def zero3_peak_census(rank: int, world_size: int, prefetch: bool, n_layer: int = 3, n_embd: int = 32,
                      vocab_size: int = 64) -> dict:
    """The largest census of each kind in step 2, the whole gradients' peak, and the engine's group sizes."""
    model = build_gpt2("tiny", vocab_size, seed=0, n_layer=n_layer, n_embd=n_embd)
    engine = ZeroEngine(model, 3, prefetch=prefetch)
    peak = {"params": 0, "grads": 0, "optimizer": 0, "total": 0, "whole_grads": 0}
    sampling = [False]

    def sample() -> None:
        if not sampling[0]:
            return
        census = engine_census(engine)
        whole = storage_census([], [p.grad for p in model.parameters()], [])["grads"]
        for kind, value in (*census.items(), ("whole_grads", whole)):
            peak[kind] = max(peak[kind], value)

    launch_reduce = engine._launch_reduce

    def reduce_and_sample(i: int) -> None:  # the group's gradients are all whole here
        sample()
        launch_reduce(i)

    engine._launch_reduce = reduce_and_sample
    for block in model.transformer.h:
        block.mlp.register_forward_pre_hook(lambda module, args: sample())
        block.mlp.register_forward_hook(
            lambda module, args, out: out.register_hook(lambda grad: sample()) and None)
    tokens = torch.randint(0, vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    for step in range(2):
        sampling[0] = step == 1  # the optimizer's moments exist from the first step on
        model(input_ids=tokens, labels=tokens).loss.backward()
        sample()
        engine.step()
    sizes = {g.name: g.padded for g in engine.groups}
    engine.remove()
    return {"peak": peak, "padded": sizes, "wpe": model.transformer.wpe.weight.numel()}
