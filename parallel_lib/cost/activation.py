"""The activations a GPT block keeps for its backward pass: the course's one activation formula.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4,
counts what one block of a GPT stores in 16-bit training with byte dropout masks:
``s·b·h·(34 + 5·a·s/h)`` bytes, and how tensor parallelism (eq. 2–3) and sequence parallelism
(eq. 4) split it. Chapter 03 asks whether a model fits with it, chapter 07 compares it with the
tensors autograd really saves under TP and SP (``tests/test_tensor_parallel.py``, byte for byte),
and the planner prices layouts with it; the paper's 34 + 5as/h is a literal in
``tests/test_memory.py``, not a second implementation.
"""

from __future__ import annotations

from parallel_lib.common.checks import positive_int
from parallel_lib.cost.shape import GPTShape

__all__ = ["activation_bytes"]


def activation_bytes(batch: int, seq: int, shape: GPTShape, tp: int = 1, sequence_parallel: bool = False,
                     attention_scores: bool = True, dropout: bool = True, bytes_per_element: int = 2,
                     mask_bytes: int = 1, recompute: bool = False) -> float:
    """Activation bytes a rank keeps for backward (Korthikanti et al. 2022, eqs. 2–4 with the defaults).

    Per block: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallelism, where the 10 (the
    two layer norms' inputs, the two column-parallel layers' inputs, two dropout masks) stays whole
    on every rank; sequence parallelism splits it too, ``s·b·h·(34/t + 5·a·s/(h·t))``: the
    column-parallel layers keep only their slice of the input and gather it again in backward
    (:func:`~parallel_lib.tensor_parallel.regions.sequence_parallel_linear`, as Megatron-LM does).

    The terms, for ``e = bytes_per_element`` and masks of ``mask_bytes``: layer-norm inputs ``2e`` and
    column-parallel inputs ``2e`` (whole, or ``/t`` under SP), residual dropout masks ``2·mask_bytes``
    (ditto), q, k, v, the projection's input and the MLP's two ``4h`` tensors ``12e/t``; per attention
    score (``a·s²·b/t``) the softmax output ``e``, its dropout mask and dropped output ``mask_bytes + e``.
    The defaults are the paper's 16-bit training with byte masks; ``dropout=False`` leaves the masks
    and the dropped scores out. Layer norms' statistics (two fp32 values per token and norm) are not
    counted (the paper leaves them out; they are ``16·b·s`` bytes per block). The block is GPT-2's:
    a Llama shape is counted by its width and heads as if its MLP were 4h GELU and every head had its
    own keys and values (its SwiGLU keeps somewhat more, its grouped-query attention less).

    ``recompute``: full activation recomputation (``torch.utils.checkpoint`` around each block,
    Korthikanti et al. sec. 5): every block keeps only its input, ``e·s·b·h`` (``/t`` under SP), and
    backward rebuilds one block's activations at a time, so one block's full set comes on top.

    Args:
        batch: sequences in the micro-batch (b).
        seq: tokens per sequence (s).
        shape: the model (its layers, width and heads; a pipeline stage's layers for one stage).
        tp: tensor-parallel ranks (t).
        sequence_parallel: Megatron's sequence parallelism on top of tensor parallelism.
        attention_scores: the score matrices are stored (False: a FlashAttention-style kernel).
        dropout: dropout masks and dropped scores are stored.
        bytes_per_element: bytes of an activation (2 for 16-bit training, 4 for fp32).
        mask_bytes: bytes of a dropout mask element (1 for bools).
        recompute: full activation recomputation of every block.

    Returns:
        Bytes, summed over the shape's layers.

    Raises:
        ValueError: a size, ``tp``, ``bytes_per_element`` or ``mask_bytes`` not an int >= 1.
    """
    b, s, t = positive_int("batch", batch), positive_int("seq", seq), positive_int("tp", tp)
    e, m = positive_int("bytes_per_element", bytes_per_element), positive_int("mask_bytes", mask_bytes)
    h, a = shape.n_embd, shape.n_head
    masks = m if dropout else 0
    scores = (e + (masks + e if dropout else 0)) * a * s / (h * t) if attention_scores else 0.0
    kept_whole = 4 * e + 2 * masks  # norms' and column-parallel layers' inputs, residual dropout masks
    replicated = kept_whole / t if sequence_parallel else kept_whole
    block = s * b * h * (replicated + 12 * e / t + scores)
    if recompute:
        block_input = s * b * h * e / (t if sequence_parallel else 1)
        return shape.n_layer * block_input + block
    return shape.n_layer * block
