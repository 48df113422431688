"""The one GPT-2: nanoGPT-sized, Hugging Face's parameter names and layout, parts a parallelism swaps.

::

    GPT2
    ├── transformer
    │   ├── wte (V, h)  wpe (n_positions, h)  drop          embed(ids, positions)
    │   ├── h[i]: ln_1 ─ attn (c_attn, c_proj) ─ + ─ ln_2 ─ mlp (c_fc, c_proj) ─ +
    │   └── ln_f
    └── lm_head (weight tied to transformer.wte.weight)      logits and loss

Every chapter's parallel model is this one with parts swapped: tensor parallelism puts column
and row layers into ``attn`` and ``mlp`` and vocabulary-parallel parts into ``wte`` and
``lm_head`` (:func:`parallel_lib.tensor_parallel.parallelize_tp`); a pipeline stage runs a slice
of ``transformer.h`` plus the ends; the inference engine passes a KV cache to each block.

The state dict is Hugging Face's ``GPT2LMHeadModel``'s, key for key and tensor for tensor
(weights of the blocks stored (in, out) as its ``Conv1D``, :mod:`.linear`), so
``model.load_state_dict(hf.state_dict())`` and back are exact (:mod:`.hf`). The model runs
in whatever dtype its parameters have (fp32, bf16, fp16): no buffer is fixed to fp32.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from parallel_lib.common.models import PositionEmbedding, gpt2_config
from parallel_lib.common.training import weighted_cross_entropy
from parallel_lib.models.attention import CausalSelfAttention, KVStore, allowed_keys
from parallel_lib.models.dropout import DropoutStream, SeededDropout
from parallel_lib.models.linear import Conv1D
from parallel_lib.models.mlp import MLP

__all__ = ["Block", "GPT2Transformer", "LMHead", "GPT2", "check_config", "build_model", "init_weights"]

# what the one model implements of GPT2Config: any other value would silently compute something else
_SUPPORTED = dict(activation_function="gelu_new", scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False, add_cross_attention=False, tie_word_embeddings=True)


def check_config(config: Any) -> Any:
    """``config`` after checking that the one model can run it as Hugging Face would.

    Raises:
        TypeError: ``config`` lacks a GPT-2 size field.
        ValueError: ``n_embd`` not divisible by ``n_head``, or a setting this model does not implement.
    """
    missing = [f for f in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if not hasattr(config, f)]
    if missing:
        raise TypeError(f"config must be a GPT2Config (e.g. gpt2_config('tiny')), got {type(config).__name__} "
                        f"without {missing}")
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}; choose a head "
                         "count that divides the width")
    for field, value in _SUPPORTED.items():
        if getattr(config, field, value) != value:
            raise ValueError(f"config.{field}={getattr(config, field)!r} is not implemented by the one GPT-2 "
                             f"(it supports {field}={value!r}); use Hugging Face's GPT2LMHeadModel for it")
    return config


class Block(nn.Module):
    """One transformer block: ``x + attn(ln_1(x))``, then ``+ mlp(ln_2(x))``.

    Args:
        config: the model's ``GPT2Config``.
        layer: the block's index in the whole model (names its cache entries and dropout sites).
        stream: the model's dropout stream.
    """

    def __init__(self, config: Any, layer: int, stream: DropoutStream) -> None:
        super().__init__()
        self.layer = layer
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer, stream, (3 * layer + 2, 3 * layer + 3))
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config, stream, 3 * layer + 4)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, cache: Optional[KVStore] = None) -> torch.Tensor:
        """``x`` (b, s, h); ``allowed`` (b or 1, 1, s, T) (:func:`.attention.allowed_keys`); an optional cache."""
        x = x + self.attn(self.ln_1(x), allowed, cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    """The body (Hugging Face's ``GPT2Model``): embeddings, blocks, final layer norm."""

    def __init__(self, config: Any, stream: DropoutStream) -> None:
        super().__init__()
        self.stream = stream
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = PositionEmbedding(config.n_positions, config.n_embd)
        self.drop = SeededDropout(config.embd_pdrop, stream, 1)
        self.h = nn.ModuleList(Block(config, i, stream) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token plus position embeddings (b, s, h), dropped out; ``positions`` default to ``0..s-1``."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        where = self.wpe(positions)  # first: it names a sequence longer than the model, or not splittable
        return self.drop(self.wte(input_ids) + where)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                positions: Optional[torch.Tensor] = None, allowed: Optional[torch.Tensor] = None,
                cache: Optional[KVStore] = None) -> torch.Tensor:
        """The final hidden states (b, s, h), after ``ln_f``: see :meth:`GPT2.forward` for the arguments."""
        _check_ids(input_ids, attention_mask)
        if self.training:
            self.stream.start_forward()
        if allowed is None:
            allowed = allowed_keys(input_ids.shape[1], attention_mask, input_ids.device)
        x = self.embed(input_ids, positions)
        for block in self.h:
            x = block(x, allowed, cache)
        return self.ln_f(x)


class LMHead(nn.Module):
    """The output layer, ``logits = x Eᵀ`` with ``E`` the token embedding (tied), and the course's loss.

    Args:
        weight: the token embedding's weight (the same Parameter: tied).
    """

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)  # (b, s, V)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sum(ce · weights) / sum(weights)`` (all ones when ``weights`` is None), in fp32."""
        if weights is None:
            weights = torch.ones(labels.shape, device=labels.device)
        return weighted_cross_entropy(logits, labels, weights)


class GPT2(nn.Module):
    """GPT-2 with a language-modelling head (see the module docstring).

    Args:
        config: a ``GPT2Config`` (:func:`parallel_lib.common.models.gpt2_config`).
        seed: the seed of the initial weights (:func:`init_weights`) and of every dropout mask
            (:mod:`.dropout`). Building never touches the caller's random stream.

    Raises:
        TypeError, ValueError: see :func:`check_config`.
    """

    def __init__(self, config: Any, seed: int = 0) -> None:
        super().__init__()
        self.config = check_config(config)
        self.dropout_stream = DropoutStream(seed)
        with torch.random.fork_rng(devices=[]):  # nn.Embedding draws its own init: keep it off the caller's stream
            self.transformer = GPT2Transformer(config, self.dropout_stream)
        self.lm_head = LMHead(self.transformer.wte.weight)
        init_weights(self, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                positions: Optional[torch.Tensor] = None, allowed: Optional[torch.Tensor] = None,
                cache: Optional[KVStore] = None) -> torch.Tensor:
        """Logits (b, s, V) of token ids (b, s).

        Args:
            input_ids: (b, s) token ids.
            attention_mask: (b, s), 1 on tokens and 0 on padding (left or right); None: no padding.
            positions: (s,) or (b, s) positions (default ``0..s-1``; the engine passes the cache slots').
            allowed: (b or 1, 1, s, T) what each query may see; overrides ``attention_mask`` (the engine's).
            cache: a :class:`~.attention.KVStore` every block appends to and reads from.

        Raises:
            TypeError: ``input_ids`` is not an integer tensor.
            ValueError: ``input_ids`` is not (b, s), ``attention_mask`` has another shape, or the
                sequence is longer than ``n_positions``.
        """
        return self.lm_head(self.transformer(input_ids, attention_mask, positions=positions, allowed=allowed,
                                             cache=cache))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The head's weighted cross-entropy of ``logits`` (what ``forward`` returned) against ``labels``."""
        return self.lm_head.loss(logits, labels, weights)


def _check_ids(input_ids: Any, attention_mask: Optional[torch.Tensor]) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"input_ids must be an integer tensor of token ids, got "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {tuple(input_ids.shape)}; "
                         "add a batch dimension with input_ids[None]")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(attention_mask.shape)}")


def init_weights(model: GPT2, seed: int) -> GPT2:
    """GPT-2's initialisation from ``seed``, without touching the caller's random stream.

    Weights and embeddings ~ N(0, ``initializer_range``), the residual projections' (``c_proj``)
    scaled by ``1/sqrt(2 n_layer)`` (GPT-2 paper, section 2.3), biases 0, layer norms 1 and 0.
    """
    std, n_layer = model.config.initializer_range, model.config.n_layer
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, module in model.named_modules():
            if isinstance(module, Conv1D):
                scale = 1.0 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 1.0
                module.weight.normal_(0.0, std * scale)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
    return model


def build_model(name: str = "tiny", vocab_size: int = 50257, seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides: Any) -> GPT2:
    """A freshly initialised :class:`GPT2` of a named size (``GPT2_SIZES``), in ``dtype``.

    The same arguments give bit-identical weights in any process. Dropout is seeded by ``seed`` too.

    Args:
        name, vocab_size, **overrides: :func:`parallel_lib.common.models.gpt2_config`'s.
        seed: the seed of the weights and of the dropout masks.
        dtype: the parameters' dtype (fp32, bf16, fp16).

    Raises:
        ValueError: see :func:`~parallel_lib.common.models.gpt2_config`; ``dtype`` not a floating dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype (torch.float32, torch.bfloat16, torch.float16), "
                         f"got {dtype!r}")
    return GPT2(gpt2_config(name, vocab_size, **overrides), seed).to(dtype)
