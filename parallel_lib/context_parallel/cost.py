"""Bytes on the wire per rank for context parallelism, what attention keeps for backward, when a ring step hides.

One key (or value) block is ``b · n · (s/cp) · d`` elements: one rank's tokens of every head.

- **Ring** (:mod:`.ring`): forward, cp − 1 steps each send one K and one V block
  (``2 · (cp − 1)`` blocks). Backward, the K and V blocks go round again (cp − 1 steps) and the
  dK, dV accumulators travel one step further home (cp steps, in fp32 whatever the inputs'
  dtype: they sum cp contributions). Nothing else: dQ stays on its rank.
- **Ulysses** (:mod:`.ulysses`): forward, one all-to-all of q, k and v together (three blocks)
  and one of the output (one block); backward, one of dO and one of dQ, dK, dV. An all-to-all
  keeps 1/cp of its tensor and sends (cp − 1)/cp of it.

In terms of the whole sequence's K and V (cp blocks each): the ring's forward sends
``(cp − 1)/cp`` of all of it from every rank, about constant as cp grows, like an all-gather;
Ulysses' forward sends ``4 · (cp − 1)/cp²`` of one of them, falling as 1/cp. The collective
counter (:mod:`parallel_lib.runtime.collectives`) measures both; the tests put them side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel_lib.common.checks import check_choice, check_number, positive_int, positive_number

__all__ = ["WireBytes", "METHODS", "cp_wire_bytes", "attention_saved_bytes", "ring_step_flops", "RingStepTime",
           "ring_step_time", "hiding_seq_len"]

METHODS = ("ring", "ulysses")
GRAD_ITEMSIZE = 4  # the ring's dK/dV accumulators are fp32


@dataclass(frozen=True)
class WireBytes:
    """Bytes one rank sends for one attention call, forward and backward."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def cp_wire_bytes(method: str, batch: int, heads: int, seq_len: int, head_dim: int, cp: int,
                  itemsize: int = 4) -> WireBytes:
    """What one rank sends for one context-parallel attention (module docstring).

    Args:
        method: "ring" or "ulysses".
        batch, heads, seq_len, head_dim: the attention's shape (the whole sequence).
        cp: ranks sharing the sequence.
        itemsize: bytes per element of q, k, v (4 for fp32, 2 for bf16).

    Returns:
        :class:`WireBytes`.

    Raises:
        ValueError: an unknown method; a size that is not a positive int; ``seq_len`` not divisible by cp.
    """
    check_choice("method", method, METHODS)
    b, n, s, d, cp, itemsize = (positive_int(name, value) for name, value in (
        ("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim), ("cp", cp),
        ("itemsize", itemsize)))
    if s % cp:
        raise ValueError(f"seq_len must be divisible by cp, got seq_len={s}, cp={cp}")
    block = b * n * (s // cp) * d  # elements of one K (or V) block
    if method == "ring":
        kv = 2 * (cp - 1) * block * itemsize                         # K and V, cp − 1 steps
        return WireBytes(forward=kv, backward=kv + 2 * cp * block * GRAD_ITEMSIZE)
    share = (cp - 1) / cp                                             # an all-to-all keeps 1/cp at home
    return WireBytes(forward=share * 4 * block * itemsize, backward=share * 4 * block * itemsize)


def attention_saved_bytes(method: str, batch: int, heads: int, seq_len: int, head_dim: int,
                          causal: bool = False, cp: int = 1) -> int:
    """Bytes one rank's attention keeps for backward beyond its inputs q, k, v (fp32), by what it saves.

    - "full" (:func:`.tiled.full_attention`): the probabilities, ``b · n · s²`` fp32 (the softmax's
      output, which the product with V saves too: one tensor), and under a causal mask the
      (s, s) boolean mask ``masked_fill`` keeps: s² bytes;
    - "tiled" (:func:`.tiled.tiled_attention`): the output ``b · n · s · d`` and the softmax's
      log-sum-exp ``b · n · s``, fp32: nothing grows with s²;
    - "ring": the tiled attention's, for this rank's s/cp queries;
    - "ulysses": for its n/cp heads over the whole sequence, the q, k, v the all-to-all brought
      (three tensors in one), the output and the log-sum-exp, and the s positions (int64).

    Raises:
        ValueError: an unknown method, a size that is not a positive int, s or n not divisible by cp.
    """
    check_choice("method", method, ("full", "tiled", "ring", "ulysses"))
    b, n, s, d, cp = (positive_int(name, value) for name, value in (
        ("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim), ("cp", cp)))
    if method in ("full", "tiled") and cp != 1:
        raise ValueError(f"method={method!r} runs on one rank: pass cp=1, got cp={cp}")
    if s % cp or (method == "ulysses" and n % cp):
        raise ValueError(f"seq_len (and for Ulysses heads) must be divisible by cp, got seq_len={s}, heads={n}, "
                         f"cp={cp}")
    if method == "full":
        return b * n * s * s * 4 + (s * s if causal else 0)
    if method == "ulysses":
        return b * (n // cp) * s * (3 * d + d + 1) * 4 + 8 * s
    return b * n * (s // cp) * (d + 1) * 4


def ring_step_flops(batch: int, heads: int, seq_len: int, head_dim: int, cp: int) -> int:
    """Floating-point operations of one forward ring step on a whole (unmasked) block.

    Two products of (s/cp)² · d multiply-adds per head: the scores ``q kᵀ`` and ``P v``, so
    ``4 · b · n · (s/cp)² · d`` (a causal block on the diagonal does half the useful work, but a
    kernel computes its tiles whole). The exponentials and rescaling are O((s/cp)²) too, with no
    factor d: left out, as FLOP counters do.

    Raises:
        ValueError: a size that is not a positive int; ``seq_len`` not divisible by cp.
    """
    b, n, s, d, cp = (positive_int(name, value) for name, value in (
        ("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim), ("cp", cp)))
    if s % cp:
        raise ValueError(f"seq_len must be divisible by cp, got seq_len={s}, cp={cp}")
    return 4 * b * n * (s // cp) ** 2 * d


@dataclass(frozen=True)
class RingStepTime:
    """One forward ring step: the block's attention against moving the next K and V block (α–β)."""

    compute_s: float
    transfer_s: float

    @property
    def hidden(self) -> bool:
        """Whether the transfer, posted before the compute, finishes before it."""
        return self.transfer_s <= self.compute_s


def ring_step_time(batch: int, heads: int, seq_len: int, head_dim: int, cp: int, flops_per_s: float,
                   latency_s: float, bytes_per_s: float, itemsize: int = 4) -> RingStepTime:
    """Predicted time of one ring step's compute (:func:`ring_step_flops` / rate) and transfer (α + bytes / β).

    Args:
        batch, heads, seq_len, head_dim, cp: the attention's shape and the ranks sharing it.
        flops_per_s: the measured compute rate (:mod:`parallel_lib.common.machine_speed`).
        latency_s, bytes_per_s: the link's α and β (one message of one K and one V block).
        itemsize: bytes per element of k and v.

    Raises:
        ValueError: bad sizes, a rate or bandwidth not > 0, a negative latency.
    """
    flops = ring_step_flops(batch, heads, seq_len, head_dim, cp)
    rate, beta = positive_number("flops_per_s", flops_per_s), positive_number("bytes_per_s", bytes_per_s)
    alpha = check_number("latency_s", latency_s, 0.0)
    block_bytes = 2 * batch * heads * (seq_len // cp) * head_dim * positive_int("itemsize", itemsize)
    return RingStepTime(compute_s=flops / rate, transfer_s=alpha + block_bytes / beta)


def hiding_seq_len(batch: int, heads: int, head_dim: int, cp: int, flops_per_s: float, latency_s: float,
                   bytes_per_s: float, itemsize: int = 4) -> int:
    """The shortest sequence (a multiple of 2·cp) at which a ring step's compute hides its transfer.

    With L = s/cp tokens per rank, compute grows as L² and the transfer as L, so past one length
    the transfer is hidden: the root of ``4 b n d L² / F = α + 2 b n d e L / β``.

    Raises:
        ValueError: as :func:`ring_step_time`.
    """
    positive_int("cp", cp)
    rate, beta = positive_number("flops_per_s", flops_per_s), positive_number("bytes_per_s", bytes_per_s)
    alpha = check_number("latency_s", latency_s, 0.0)
    per_token = batch * heads * head_dim
    quad, lin = 4 * per_token / rate, 2 * per_token * positive_int("itemsize", itemsize) / beta
    tokens = (lin + math.sqrt(lin * lin + 4 * quad * alpha)) / (2 * quad)       # L at which they are equal
    step = 2 * cp
    seq_len = max(step, math.ceil(tokens * cp / step) * step)
    while not ring_step_time(batch, heads, seq_len, head_dim, cp, rate, alpha, beta, itemsize).hidden:
        seq_len += step                                                         # rounding at the root
    return seq_len
