"""The one shape of a decoder-only transformer, for every cost formula in the course.

GPT-2's family and Llama's are one type: the fields say where they differ (a 4h GELU MLP or
SwiGLU's three matrices, multi-head or grouped-query attention, LayerNorm or RMSNorm, biases or
none, learned positions or RoPE, a tied or an untied head). Memory, traffic, FLOPs, the KV cache
and the planner all read it, so a model is described once. :data:`SHAPES` holds the published
models the chapters price, each with its source; ``tests/test_shapes.py`` builds each with Hugging
Face's own classes on the meta device and checks the parameter count to the element.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lib.common.checks import check_choice, positive_int

__all__ = ["GPTShape", "llama", "SHAPES", "LLAMA3", "shape_of"]


@dataclass(frozen=True)
class GPTShape:
    """The sizes the formulas need (GPT-2's names), for GPT-2 and Llama-family decoders alike.

    The defaults are GPT-2's block: a 4h GELU MLP, multi-head attention, LayerNorms with biases,
    biases on every linear layer, learned positions and the head tied to the token embedding.
    A Llama block sets ``ffn_hidden`` and ``gated_mlp`` (SwiGLU: gate, up and down matrices),
    ``kv_heads`` (grouped-query attention: ``kv_heads`` key/value heads of ``n_embd / n_head``),
    ``rms_norm`` (a weight, no bias), ``bias=False``, ``learned_positions=False`` (RoPE) and
    ``tied_head=False``; ``n_positions`` is then only the longest sequence.
    """

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_positions: int
    ffn_hidden: int = 0              # 0: 4 · n_embd
    kv_heads: int = 0                # 0: n_head (no grouped-query attention)
    gated_mlp: bool = False          # SwiGLU's three matrices instead of two
    rms_norm: bool = False           # RMSNorm (weight only) instead of LayerNorm (weight and bias)
    bias: bool = True                # biases on the linear layers
    learned_positions: bool = True   # a position table (GPT-2) or none (RoPE)
    tied_head: bool = True           # the head is the token embedding

    @classmethod
    def of(cls, config: object) -> GPTShape:
        """From a ``GPT2Config``."""
        return cls(*(int(getattr(config, k)) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")))

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.n_embd

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): ``kv_heads`` heads of ``n_embd / n_head``."""
        return (self.kv_heads or self.n_head) * (self.n_embd // self.n_head)

    def matmul_parameters(self) -> int:
        """One block's weight-matrix elements: the FLOPs of a token through it are twice this."""
        h = self.n_embd
        return 2 * h * h + 2 * h * self.kv_dim + (3 if self.gated_mlp else 2) * h * self.ffn

    def block_parameters(self, tp: int = 1) -> int:
        """One block's parameters on a tensor-parallel rank: matrices and column biases /t; norms, row biases whole."""
        h, norm = self.n_embd, 1 if self.rms_norm else 2
        column_biases = (h + 2 * self.kv_dim + (2 if self.gated_mlp else 1) * self.ffn) if self.bias else 0
        row_biases = 2 * h if self.bias else 0
        return (self.matmul_parameters() + column_biases) // tp + row_biases + 2 * norm * h

    def check_tp(self, tp: int) -> int:
        """``tp`` if it divides the heads, the key/value heads and the vocabulary (what tensor parallelism splits).

        Raises:
            ValueError: ``tp`` is not an int >= 1, or it leaves a head or a vocabulary row in two pieces.
        """
        positive_int("tp", tp)
        kv = self.kv_heads or self.n_head
        if self.n_head % tp or kv % tp or self.vocab_size % tp:
            raise ValueError(f"tp={tp} must divide n_head={self.n_head}, kv_heads={kv} and "
                             f"vocab_size={self.vocab_size}")
        return tp

    def block_shapes(self, tp: int = 1) -> list[tuple[int, ...]]:
        """One block's parameter shapes on a tensor-parallel rank, as Hugging Face's classes store them.

        Column-parallel layers (attention's queries, keys and values by heads, grouped-query
        attention's keys and values by key/value heads, the MLP's up and gate) keep ``1/tp`` of their
        outputs and biases; row-parallel ones (attention's output projection, the MLP's down) ``1/tp``
        of their inputs, their biases whole; norms whole. GPT-2's ``Conv1D`` stores (in, out), so its
        column split is the second dimension; Llama's ``nn.Linear`` stores (out, in).

        Raises:
            ValueError: ``tp`` does not divide the heads, the key/value heads or the vocabulary.
        """
        t, h, f, kv = self.check_tp(tp), self.n_embd, self.ffn, self.kv_dim
        if self.bias and not self.rms_norm:  # GPT-2: ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj
            return [(h,), (h,), (h, 3 * h // t), (3 * h // t,), (h // t, h), (h,), (h,), (h,), (h, f // t), (f // t,),
                    (f // t, h), (h,)]
        mlp = [(f // t, h), (f // t, h)] if self.gated_mlp else [(f // t, h)]
        return [(h // t, h), (kv // t, h), (kv // t, h), (h, h // t)] + mlp + [(h, f // t), (h,), (h,)]

    def outer_shapes(self, tp: int = 1) -> dict[str, list[tuple[int, ...]]]:
        """The shapes outside the blocks on a tensor-parallel rank (:meth:`outer_parameters`' parts).

        The token embedding and an untied head split by vocabulary rows (vocabulary-parallel), the
        position table and the final norm whole.

        Raises:
            ValueError: ``tp`` does not divide the heads, the key/value heads or the vocabulary.
        """
        t, h, V = self.check_tp(tp), self.n_embd, self.vocab_size
        norm = [(h,), (h,)] if self.bias and not self.rms_norm else [(h,)]
        return {"embedding": [(V // t, h)] + ([(self.n_positions, h)] if self.learned_positions else []),
                "head": [] if self.tied_head else [(V // t, h)], "final_norm": norm}

    def parameter_shapes(self, tp: int = 1) -> list[tuple[int, ...]]:
        """Every parameter tensor's shape on a tensor-parallel rank, in Hugging Face's order (the tied head once).

        GPT-2 (biases, LayerNorm) in ``GPT2LMHeadModel``'s order with its ``Conv1D`` weights stored
        (in, out); a Llama shape in ``LlamaForCausalLM``'s, ``nn.Linear`` weights stored (out, in).
        ``tp`` splits them as :meth:`block_shapes` and :meth:`outer_shapes` say. FSDP2 shards each
        tensor along its first dimension: :func:`parallel_lib.cost.zero.fsdp_shard_numel`.

        Raises:
            ValueError: ``tp`` does not divide the heads, the key/value heads or the vocabulary.
        """
        outer = self.outer_shapes(tp)
        return outer["embedding"] + self.block_shapes(tp) * self.n_layer + outer["final_norm"] + outer["head"]

    def outer_parameters(self, tp: int = 1) -> dict[str, int]:
        """What is outside the blocks on a tensor-parallel rank: embedding (+ positions), head, final norm."""
        h = self.n_embd
        return {"embedding": self.vocab_size * h // tp + (self.n_positions * h if self.learned_positions else 0),
                "head": 0 if self.tied_head else self.vocab_size * h // tp,
                "final_norm": (1 if self.rms_norm else 2) * h}

    def parameters(self, tp: int = 1) -> int:
        """Parameters one tensor-parallel rank holds (the whole model at ``tp = 1``; a tied head once).

        Raises:
            ValueError: ``tp`` does not divide the heads, the key/value heads or the vocabulary.
        """
        self.check_tp(tp)
        return self.n_layer * self.block_parameters(tp) + sum(self.outer_parameters(tp).values())


def llama(n_layer: int, n_embd: int, n_head: int, ffn_hidden: int, kv_heads: int, vocab_size: int,
          context: int) -> GPTShape:
    """A Llama decoder: SwiGLU, grouped-query attention, RMSNorm, RoPE, an untied head, no biases."""
    return GPTShape(n_layer, n_embd, n_head, vocab_size, context, ffn_hidden=ffn_hidden, kv_heads=kv_heads,
                    gated_mlp=True, rms_norm=True, bias=False, learned_positions=False, tied_head=False)


# Llama Team 2024, "The Llama 3 Herd of Models", table 3 (layers, model dimension, FFN dimension, heads,
# 8 key/value heads, vocabulary 128,256); 8,192 tokens, the pre-training context (sec. 3.4.1).
LLAMA3 = {"8B": llama(32, 4096, 32, 14_336, 8, 128_256, 8192),
          "70B": llama(80, 8192, 64, 28_672, 8, 128_256, 8192),
          "405B": llama(126, 16_384, 128, 53_248, 8, 128_256, 8192)}

# GPT-2: Radford et al. 2019, table 2, and Hugging Face's configs (vocabulary 50,257, 1,024 positions).
# LLaMA-2: Touvron et al. 2023, "Llama 2", table 1 and the Hugging Face configs (intermediate_size,
# num_key_value_heads: 8 for 70B, none for 7B and 13B; vocabulary 32,000; 4,096 tokens).
SHAPES: dict[str, GPTShape] = {
    "gpt2 (124M)": GPTShape(12, 768, 12, 50257, 1024),
    "gpt2-medium (355M)": GPTShape(24, 1024, 16, 50257, 1024),
    "gpt2-large (774M)": GPTShape(36, 1280, 20, 50257, 1024),
    "gpt2-xl (1.5B)": GPTShape(48, 1600, 25, 50257, 1024),
    "llama-2-7b": llama(32, 4096, 32, 11_008, 32, 32_000, 4096),
    "llama-2-13b": llama(40, 5120, 40, 13_824, 40, 32_000, 4096),
    "llama-2-70b": llama(80, 8192, 64, 28_672, 8, 32_000, 4096),
    "llama-3-8b": LLAMA3["8B"],
    "llama-3-70b": LLAMA3["70B"],
    "llama-3-405b": LLAMA3["405B"],
}


def shape_of(model: str | GPTShape) -> GPTShape:
    """``model`` itself if it is a :class:`GPTShape`, else the published shape of that name in :data:`SHAPES`.

    Raises:
        ValueError: ``model`` names no model in :data:`SHAPES` (the message lists them).
    """
    if isinstance(model, GPTShape):
        return model
    return SHAPES[check_choice("model", model, SHAPES)]
