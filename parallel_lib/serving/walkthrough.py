"""Chapter 13's walkthrough: the few requests and the small pool that the notebook, its widget and its figure replay.

Six requests of 1 to 13 prompt tokens and 3 to 12 new ones, on the tiny GPT-2 of the serving tests
(vocabulary 97, context 128, weights drawn with a wide initialisation: a random model with GPT-2's
0.02 mostly repeats one token, which proves little). With a pool of 6 blocks of 4 slots and 4
sequences per step, the engine runs out of blocks several times: its step records show admission,
growth block by block, preemption and recomputation, which is what the chapter's widget replays
(``figures/serving_steps.png`` is the same run on paper). The same run checks the block-table
exercise against the engine's own pool.
"""

from __future__ import annotations

from typing import Any

from parallel_lib.inference.batch import Request
from parallel_lib.inference.strategies import ServeConfig
from parallel_lib.serving.engine import ServingEngine

__all__ = ["PROMPTS", "NEW", "MODEL", "walkthrough_requests", "walkthrough_model", "walkthrough_run"]

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [40, 41, 42], list(range(20, 33))]
NEW = [7, 3, 9, 5, 12, 6]
MODEL = ServeConfig(initializer_range=0.3)  # the tiny GPT-2: 4 layers of 64, vocabulary 97, context 128


def walkthrough_requests() -> list[Request]:
    """The six greedy requests (prompts :data:`PROMPTS`, new tokens :data:`NEW`)."""
    return [Request(list(p), n) for p, n in zip(PROMPTS, NEW)]


def walkthrough_model() -> Any:
    """The tiny GPT-2 of :data:`MODEL` (a Hugging Face ``GPT2LMHeadModel``, seeded: the same weights every call)."""
    return MODEL.build()


def walkthrough_run(model: Any, num_blocks: int = 6, block_size: int = 4, max_batch: int = 4,
                    **options: Any) -> ServingEngine:
    """Serve the walkthrough's requests to their end; returns the engine (``records``, ``results``, ``blocks``).

    Args:
        model: the tiny GPT-2 (:func:`walkthrough_model`).
        num_blocks, block_size, max_batch: the engine's pool and batch (the defaults run out of blocks).
        options: more :class:`~parallel_lib.serving.engine.ServingEngine` arguments (``prefix_caching``,
            ``max_step_tokens``).
    """
    engine = ServingEngine(model, num_blocks=num_blocks, block_size=block_size, max_batch=max_batch, **options)
    engine.run(walkthrough_requests())
    return engine
