"""Mixtures of experts by the formula: parameters (total and active), memory per GPU, all-to-all bytes per step.

A mixture-of-experts model is a decoder whose MLPs (all of them, or all but the first few) are
``E`` experts of which each token uses ``k``, plus optionally shared experts every token uses.
:class:`MoEShape` holds the sizes; the counts follow from them:

- **parameters**: embeddings, head, every block's attention and norms, the dense MLPs, and per
  mixture layer the router (``E · h``) and ``E + shared`` experts; **active** parameters are those
  one token's forward reads: the same with ``k + shared`` experts per mixture layer. Tested against
  the published literals of Mixtral 8x7B (46.7B, 12.9B active: Mistral AI's announcement "Mixtral of
  experts", December 2023; the paper, Jiang et al. 2024, rounds them to 47B and 13B, its sec. 2 and
  table 1 give the sizes) and DeepSeek-V3 (671B, 37B active: DeepSeek-AI 2024, "DeepSeek-V3 Technical
  Report", abstract and sec. 1; the sizes in sec. 2 and 4.2), and the tensor counts of Hugging Face's
  classes, in ``tests/test_cost_moe.py``, and against the tensor census of the
  course's mixture GPT-2 on ranks (``tests/test_expert_parallel_ranks.py``).
- **memory per GPU** (:func:`moe_memory`): experts are sharded over ``ep`` ranks, everything else
  is replicated; the ``dp`` data-parallel ranks hold ``ep``-sized groups, so an expert's copies
  are ``dp / ep`` (its gradients are averaged over those) while a replicated parameter's are
  ``dp``. ZeRO shards each over its own copies (:func:`~parallel_lib.cost.zero.zero_memory`).
- **traffic** (:func:`ep_traffic`): per mixture layer and rank with ``T`` tokens, ``k`` choices,
  width ``h`` and ``b`` bytes per element, nothing dropped, the all-to-alls move::

      forward:  the counts  (E int64 values)                    E · 8 bytes
                dispatch    T · k rows of h                     T · k · h · b bytes
                combine     the same rows back                  T · k · h · b bytes
      backward: the two row all-to-alls again, reversed         2 · T · k · h · b bytes

  and ``(ep-1)/ep`` of each message leaves the rank under balanced routing (a share ``1/ep`` of
  the rows is for the rank's own experts). The collective counter of a real run equals it
  exactly (``tests/test_expert_parallel_ranks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from parallel_lib.common.checks import check_choice, check_int, positive_int
from parallel_lib.cost.zero import BYTES_PER_PARAM, zero_memory

__all__ = ["MoEShape", "MIXTRAL_8X7B", "DEEPSEEK_V3", "gqa_attention", "mla_attention", "gpt2_moe_shape",
           "EPTraffic", "ep_traffic", "moe_memory", "moe_step_traffic", "COUNT_BYTES"]

COUNT_BYTES = 8  # the counts travel as int64


def gqa_attention(hidden: int, n_head: int, kv_heads: int, bias: bool = False) -> int:
    """Parameters of one grouped-query attention: ``q`` and ``o`` of ``h × h``, ``k`` and ``v`` of ``h × kv``.

    Raises:
        ValueError: a count below 1, or heads that do not divide ``hidden``.
    """
    positive_int("hidden", hidden)
    positive_int("n_head", n_head)
    check_int("kv_heads", kv_heads, 1, n_head)
    if hidden % n_head or n_head % kv_heads:
        raise ValueError(f"n_head={n_head} must divide hidden={hidden} and kv_heads={kv_heads} divide n_head")
    kv = kv_heads * (hidden // n_head)
    return 2 * hidden * hidden + 2 * hidden * kv + ((2 * hidden + 2 * kv) if bias else 0)


def mla_attention(hidden: int, n_head: int, q_rank: int, kv_rank: int, nope_dim: int, rope_dim: int,
                  v_dim: int) -> int:
    """Parameters of DeepSeek's multi-head latent attention (DeepSeek-V2 sec. 2.1; V3 sec. 2.1.1).

    Queries go through a rank-``q_rank`` bottleneck (down, RMSNorm, up to ``n_head · (nope + rope)``);
    keys and values through one of rank ``kv_rank`` (down to ``kv_rank + rope``: the shared rotary
    key rides along; RMSNorm; up to ``n_head · (nope + v)``); the output projection is
    ``n_head · v -> hidden``. No biases.

    Raises:
        ValueError: a size below 1.
    """
    for name, value in (("hidden", hidden), ("n_head", n_head), ("q_rank", q_rank), ("kv_rank", kv_rank),
                        ("nope_dim", nope_dim), ("rope_dim", rope_dim), ("v_dim", v_dim)):
        positive_int(name, value)
    queries = hidden * q_rank + q_rank + q_rank * n_head * (nope_dim + rope_dim)
    keys_values = hidden * (kv_rank + rope_dim) + kv_rank + kv_rank * n_head * (nope_dim + v_dim)
    return queries + keys_values + n_head * v_dim * hidden


@dataclass(frozen=True)
class MoEShape:
    """The sizes of a mixture-of-experts decoder (see the module docstring).

    ``attention`` and ``norms`` are one block's parameters (projections with any biases, and the
    norms around them); an expert is SwiGLU's three ``h × ffn`` matrices (``gated``) or GPT-2's
    two with biases. The first ``dense_layers`` blocks keep a dense MLP of ``dense_ffn``.
    """

    name: str
    n_layer: int
    n_embd: int
    vocab_size: int
    attention: int
    norms: int
    n_experts: int
    top_k: int
    expert_ffn: int
    gated: bool = True
    shared_experts: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0
    positions: int = 0          # rows of a learned position table (GPT-2); 0 with rotary positions
    final_norm: int = 0
    tied_head: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "vocab_size", "n_experts", "expert_ffn"):
            positive_int(name, getattr(self, name))
        check_int("top_k", self.top_k, 1, self.n_experts, hint="a token cannot choose more experts than there are")
        check_int("dense_layers", self.dense_layers, 0, self.n_layer)
        for name in ("attention", "norms", "shared_experts", "dense_ffn", "positions", "final_norm"):
            check_int(name, getattr(self, name), 0)

    def mlp_parameters(self, ffn: int) -> int:
        """One MLP of inner width ``ffn``: ``3·h·ffn`` (gated) or ``2·h·ffn + ffn + h`` (GPT-2's, with biases)."""
        h = self.n_embd
        return 3 * h * ffn if self.gated else 2 * h * ffn + ffn + h

    @property
    def expert_parameters(self) -> int:
        """One expert's parameters."""
        return self.mlp_parameters(self.expert_ffn)

    @property
    def router_parameters(self) -> int:
        """One mixture layer's router: ``E · h`` (DeepSeek-V3's per-expert bias that steers the choice is a buffer,
        set by a rule rather than trained, and not counted)."""
        return self.n_experts * self.n_embd

    @property
    def moe_layers(self) -> int:
        return self.n_layer - self.dense_layers

    def outer_parameters(self) -> int:
        """Token embedding, position table, final norm and (untied) head."""
        h = self.n_embd
        return (self.vocab_size + self.positions) * h + self.final_norm + (0 if self.tied_head else self.vocab_size * h)

    def replicated_parameters(self) -> int:
        """Everything but the routed experts: what every expert-parallel rank holds whole."""
        dense = self.dense_layers * (self.attention + self.norms + self.mlp_parameters(self.dense_ffn))
        moe = self.moe_layers * (self.attention + self.norms + self.router_parameters
                                 + self.shared_experts * self.expert_parameters)
        return self.outer_parameters() + dense + moe

    def routed_parameters(self) -> int:
        """Every routed expert of every mixture layer."""
        return self.moe_layers * self.n_experts * self.expert_parameters

    def parameters(self) -> int:
        """All parameters."""
        return self.replicated_parameters() + self.routed_parameters()

    def active_parameters(self) -> int:
        """The parameters one token's forward reads: ``k`` routed experts per mixture layer, embeddings included."""
        return self.replicated_parameters() + self.moe_layers * self.top_k * self.expert_parameters

    def rank_parameters(self, ep: int) -> int:
        """Parameters on one expert-parallel rank: everything replicated, ``E/ep`` experts of each layer.

        Raises:
            ValueError: ``ep`` does not divide the experts.
        """
        _check_ep(self.n_experts, ep)
        return self.replicated_parameters() + self.routed_parameters() // ep


def _check_ep(n_experts: int, ep: int) -> None:
    positive_int("ep", ep)
    if n_experts % ep:
        raise ValueError(f"ep={ep} must divide the {n_experts} experts: each rank holds E/ep of them")


def gpt2_moe_shape(n_layer: int, n_embd: int, vocab_size: int, n_positions: int, n_experts: int, top_k: int = 1,
                   shared_experts: int = 0) -> MoEShape:
    """The course's mixture GPT-2 (:func:`parallel_lib.expert_parallel.moe_gpt2`): GPT-2 with every MLP a mixture.

    Experts are GPT-2's MLP (``4h``, biases); the router has no bias; the head is tied.
    """
    h = positive_int("n_embd", n_embd)
    return MoEShape("GPT-2 MoE", n_layer, h, vocab_size, attention=4 * h * h + 4 * h, norms=4 * h,
                    n_experts=n_experts, top_k=top_k, expert_ffn=4 * h, gated=False, shared_experts=shared_experts,
                    positions=n_positions, final_norm=2 * h, tied_head=True)


# Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", sec. 2, table 1): Mistral 7B's 32 blocks, h 4096, 32 heads
# with 8 key/value heads, every MLP 8 SwiGLU experts of 14336, top-2, vocabulary 32000, untied head, RMSNorm
MIXTRAL_8X7B = MoEShape("Mixtral 8x7B", n_layer=32, n_embd=4096, vocab_size=32000,
                        attention=gqa_attention(4096, 32, 8), norms=2 * 4096, n_experts=8, top_k=2,
                        expert_ffn=14336, final_norm=4096)

# DeepSeek-V3 (DeepSeek-AI 2024, sec. 4.2 "Model Hyper-Parameters"): 61 blocks, h 7168, multi-head latent attention
# (128 heads, query rank 1536, key-value rank 512, 128 + 64 per head for keys, 128 for values); the first 3 blocks
# dense (18432, the published config's intermediate size), the others 1 shared and 256 routed experts of 2048,
# top-8; vocabulary 129280, untied head. The multi-token-prediction module (14B more) is not in the 671B.
DEEPSEEK_V3 = MoEShape("DeepSeek-V3", n_layer=61, n_embd=7168, vocab_size=129280,
                       attention=mla_attention(7168, 128, 1536, 512, 128, 64, 128), norms=2 * 7168, n_experts=256,
                       top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3, dense_ffn=18432, final_norm=7168)


@dataclass(frozen=True)
class EPTraffic:
    """One mixture layer's all-to-alls on one rank, forward and backward (balanced routing)."""

    calls_forward: int    # counts, dispatch, combine
    calls_backward: int   # combine and dispatch, reversed
    row_bytes: int        # one all-to-all of rows: T · k · h · b
    count_bytes: int      # the all-to-all of counts: E · 8
    ep: int

    @property
    def message_bytes(self) -> int:
        """Every message of forward and backward: ``4 · T·k·h·b + E·8``."""
        return 4 * self.row_bytes + self.count_bytes

    @property
    def wire_bytes(self) -> float:
        """What leaves the rank: ``(ep-1)/ep`` of every message."""
        return self.message_bytes * (self.ep - 1) / self.ep


def ep_traffic(tokens: int, top_k: int, hidden: int, n_experts: int, ep: int, dtype_bytes: int = 4) -> EPTraffic:
    """The all-to-all traffic of one mixture layer on one rank (see the module docstring).

    Args:
        tokens: tokens on this rank (batch · sequence / ep).
        top_k: choices per token.
        hidden: the token width.
        n_experts: E.
        ep: ranks of the expert-parallel group.
        dtype_bytes: bytes per element of the activations (4 fp32, 2 bf16).

    Raises:
        ValueError: a count below 1 (``tokens`` may be 0).
    """
    check_int("tokens", tokens, 0)
    for name, value in (("top_k", top_k), ("hidden", hidden), ("n_experts", n_experts), ("ep", ep),
                        ("dtype_bytes", dtype_bytes)):
        positive_int(name, value)
    return EPTraffic(3, 2, tokens * top_k * hidden * dtype_bytes, n_experts * COUNT_BYTES, ep)


def moe_step_traffic(shape: MoEShape, tokens: int, ep: int, dtype_bytes: int = 2, layers: Optional[int] = None
                     ) -> EPTraffic:
    """A rank's all-to-alls of one training step: :func:`ep_traffic` of each of its mixture layers, summed.

    Args:
        shape: the model.
        tokens: tokens the rank routes in the step (its micro-batches together).
        ep: ranks of the expert-parallel group.
        dtype_bytes: bytes per element on the wire (2: bf16).
        layers: mixture layers on the rank (a pipeline stage's share); default all of them.

    Returns:
        An :class:`EPTraffic` whose calls and bytes are the step's.
    """
    layers = shape.moe_layers if layers is None else check_int("layers", layers, 0, shape.moe_layers)
    one = ep_traffic(tokens, shape.top_k, shape.n_embd, shape.n_experts, ep, dtype_bytes)
    return EPTraffic(layers * one.calls_forward, layers * one.calls_backward, layers * one.row_bytes,
                     layers * one.count_bytes, ep)


def moe_memory(shape: MoEShape, ep: int, dp: Optional[int] = None, pp: int = 1, zero: int = 0,
               precision: str = "bf16") -> dict[str, float]:
    """Model-state bytes per GPU of ``shape`` on ``dp · pp`` GPUs, experts over ``ep`` of each stage's ``dp``.

    Each pipeline stage holds ``1/pp`` of the parameters (an even split; a real one is by blocks);
    on a stage, the replicated parameters have ``dp`` copies and each expert ``dp / ep``, and
    ZeRO stage ``zero`` shards each over its copies (the ZeRO paper's formula, mixed-precision Adam
    under "bf16": 2 + 2 + 12 bytes per parameter).

    Args:
        shape: the model.
        ep: expert-parallel ranks (dividing ``dp`` and the experts).
        dp: data-parallel ranks per stage (default ``ep``).
        pp: pipeline stages.
        zero: ZeRO stage 0-3 over the copies.
        precision: "bf16" or "fp32".

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes, and ``"parameters"`` (elements on the GPU).

    Raises:
        ValueError: ``ep`` not dividing the experts or ``dp``, a count below 1, an unknown stage or precision.
    """
    _check_ep(shape.n_experts, ep)
    dp = ep if dp is None else positive_int("dp", dp)
    positive_int("pp", pp)
    check_choice("precision", precision, sorted(BYTES_PER_PARAM))
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}: the expert-parallel groups are made of data-parallel ranks")
    replicated = zero_memory(shape.replicated_parameters() / pp, dp, zero, precision)
    experts = zero_memory(shape.routed_parameters() / ep / pp, dp // ep, zero, precision)
    out = {k: replicated[k] + experts[k] for k in replicated}
    out["parameters"] = shape.rank_parameters(ep) / pp
    return out
