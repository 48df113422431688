"""Chapter 09's coding exercises: one decode step of grouped-query attention with a KV cache, checked against
Hugging Face's LLaMA attention, and the cache's write and read for requests of different lengths, checked
against the library's :class:`~parallel_lib.inference.kv_cache.KVCache` and
:class:`~parallel_lib.inference.batch.Group`.

**Against Hugging Face.** ``LlamaAttention`` (eager attention, ``num_key_value_heads`` <
``num_attention_heads``) runs the whole sequence, the cached tokens and the new one; the output
of its last position is what one decode step must give. LLaMA rotates queries and keys by their
position (RoPE) before attention and caches the rotated keys; the checker passes the identity
rotation (cos = 1, sin = 0), so the exercise is the cache and the grouping, not the rotation.
Only the positional arguments ``(hidden_states, position_embeddings, attention_mask)`` and
``config._attn_implementation`` are used, which transformers 4.53 and 5.x share.

**The wrong answers.** The empty slots of the cache hold large random numbers, so reading past
the cached tokens shows; the checker recomputes the typical mistakes (KV heads tiled instead of
grouped, no 1/√head_dim, the new token not attending to itself, every slot read, the write one
slot off or not done) and names the one that matches.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from parallel_lib.exercises._core import CheckResult, failed, is_stub, passed, require_callable, stub_result
from parallel_lib.inference.batch import Group, Request
from parallel_lib.inference.kv_cache import KVCache

__all__ = ["GQA_DECODE_STUB", "CACHE_STEP_STUB", "check_gqa_decode_step", "check_cache_step"]

GQA_DECODE_STUB = '''\
def gqa_decode_step(x, wq, wk, wv, wo, k_cache, v_cache, length):
    """One decode step of grouped-query attention with a KV cache, for requests of equal length.

    x: (batch, hidden), each request's newest token. wq: (n_heads * head_dim, hidden); wk, wv:
    (n_kv_heads * head_dim, hidden); wo: (hidden, n_heads * head_dim); nn.Linear's layout (y = x @ w.T),
    no biases. k_cache, v_cache: (batch, n_kv_heads, max_len, head_dim); slots 0 .. length-1 hold the
    earlier tokens' keys and values, the slots after them hold garbage. Query head h shares KV head
    h // (n_heads // n_kv_heads) with its group, as in LLaMA (no rotary embedding here).
    Store this token's key and value in the caches (in place), then return the attention's output
    (batch, hidden) for the new token.
    """
    ...  # your code here
'''

CACHE_STEP_STUB = '''\
def cache_step(k_cache, v_cache, k_new, v_new, lengths):
    """One decode step's KV-cache write and read, for requests of different lengths in one batch.

    k_cache, v_cache: (batch, heads, max_len, head_dim); row b holds its request's lengths[b] tokens in
    slots 0 .. lengths[b]-1 (no padding in front; the slots after them are unused).
    k_new, v_new: (batch, heads, 1, head_dim), each request's newest token. lengths: (batch,) long.
    Store the new keys and values in the caches (in place) and return (k, v, mask): k and v are the
    slots 0 .. upto-1 of every row, where upto is the longest row's length after this step, and mask
    is (batch, upto) bool, True where row b's new query may attend.
    """
    ...  # your code here
'''

# (hidden, n_heads, n_kv_heads, head_dim, batch, tokens already cached, max_len)
_GQA_CASES = ((32, 4, 2, 8, 2, 5, 9),     # groups of 2
              (32, 8, 2, 4, 3, 3, 6),     # groups of 4
              (16, 4, 1, 4, 2, 0, 4),     # one KV head (multi-query), the first token: nothing cached yet
              (24, 3, 3, 8, 1, 4, 7))     # as many KV heads as query heads: plain multi-head attention
_GARBAGE = 100.0  # the scale of what the unused slots hold


def _label(case: tuple) -> str:
    hidden, heads, kv_heads, head_dim, batch, length, max_len = case
    return f"{heads} query heads, {kv_heads} KV heads, {length} tokens cached"


def _llama_attention(hidden: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> Any:
    """A tiny ``LlamaAttention`` with eager attention, its weights from ``seed``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = LlamaAttention(config, layer_idx=0)
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
            torch.nn.init.normal_(linear.weight, std=0.3)
    return attention.eval()


def _no_rotation(batch: int, seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(batch, seq, head_dim), torch.zeros(batch, seq, head_dim)


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """(batch, seq, n·d) -> (batch, n, seq, d)."""
    return t.view(t.shape[0], t.shape[1], n, -1).transpose(1, 2)


def _gqa_case(index: int) -> dict[str, Any]:
    """Case ``index``: the module, the inputs the student gets, HF's output and the caches expected after."""
    hidden, heads, kv_heads, head_dim, batch, length, max_len = _GQA_CASES[index]
    attention = _llama_attention(hidden, heads, kv_heads, head_dim, seed=30 + index)
    g = torch.Generator().manual_seed(40 + index)
    sequence = torch.randn(batch, length + 1, hidden, generator=g)
    k_cache = torch.randn(batch, kv_heads, max_len, head_dim, generator=g) * _GARBAGE
    v_cache = torch.randn(batch, kv_heads, max_len, head_dim, generator=g) * _GARBAGE
    with torch.no_grad():
        keys, values = _heads(attention.k_proj(sequence), kv_heads), _heads(attention.v_proj(sequence), kv_heads)
        k_cache[:, :, :length], v_cache[:, :, :length] = keys[:, :, :length], values[:, :, :length]
        out = attention(sequence, _no_rotation(batch, length + 1, head_dim), None)[0][:, -1]  # HF: the last position
    after_k, after_v = k_cache.clone(), v_cache.clone()
    after_k[:, :, length], after_v[:, :, length] = keys[:, :, length], values[:, :, length]
    weights = [m.weight.detach().clone() for m in (attention.q_proj, attention.k_proj, attention.v_proj,
                                                   attention.o_proj)]
    return dict(x=sequence[:, -1].clone(), weights=weights, k_cache=k_cache, v_cache=v_cache, length=length,
                expected=out, after_k=after_k, after_v=after_v, heads=heads, kv_heads=kv_heads)


def _attend(case: dict[str, Any], k_cache: torch.Tensor, v_cache: torch.Tensor, slots: slice, tiled: bool = False,
            scale: Optional[float] = None) -> torch.Tensor:
    """The decode step's output over cache ``slots``, as a typical wrong answer computes it."""
    wq, _, _, wo = case["weights"]
    heads, kv_heads = case["heads"], case["kv_heads"]
    x = case["x"]
    head_dim = k_cache.shape[-1]
    q = (x @ wq.T).view(x.shape[0], heads, 1, head_dim)
    k, v = k_cache[:, :, slots], v_cache[:, :, slots]
    pick = torch.arange(heads) % kv_heads if tiled else torch.arange(heads) // (heads // kv_heads)
    k, v = k[:, pick], v[:, pick]
    scores = q @ k.transpose(-1, -2) * (head_dim ** -0.5 if scale is None else scale)
    out = (scores.softmax(-1) @ v).reshape(x.shape[0], heads * head_dim)
    return out @ wo.T


def _output_mistake(case: dict[str, Any], got: torch.Tensor) -> tuple[str, str]:
    length, kv_heads, heads = case["length"], case["kv_heads"], case["heads"]
    k, v = case["after_k"], case["after_v"]
    hidden = case["x"].shape[1]
    mistakes = [
        (dict(slots=slice(0, length + 1), tiled=True), "query heads were paired with the wrong KV heads (the KV "
         "heads tiled, not grouped)", "with 4 query heads and 2 KV heads, which KV head do query heads 0 and 1 "
         "share?"),
        (dict(slots=slice(0, length + 1), scale=1.0), "the scores were not scaled",
         "softmax(q·k) grows peakier with head_dim unless the scores are scaled down (Vaswani et al. 2017, 3.2.1)"),
        (dict(slots=slice(0, length + 1), scale=hidden ** -0.5), "the scores were scaled by the model's width",
         "each score is a dot product of one head's vectors"),
        (dict(slots=slice(0, k.shape[2])), "attention read the unused slots after the new token",
         "the slots after the cached tokens hold garbage: read only what has been written"),
        (dict(slots=slice(0, length)), "the new token does not attend to itself",
         "a decoding token sees every earlier token and itself, like the last row of a causal mask"),
    ]
    for kwargs, what, hint in mistakes:
        if kwargs.get("tiled") and kv_heads in (1, heads):  # tiling and grouping agree there
            continue
        if length == 0 and kwargs["slots"] == slice(0, 0):
            continue
        if torch.allclose(got, _attend(case, k, v, **kwargs), atol=1e-4, rtol=1e-4):
            return what, hint
    worst = float((got - case["expected"]).abs().max())
    return (f"the output differs from Hugging Face's LlamaAttention by up to {worst:.3g}",
            "compare each step with section 2's code: which slots a query may read, which KV head each query "
            "head reads, the scale of the scores, and the output projection")


def _cache_mistake(case: dict[str, Any], name: str, before: torch.Tensor, got: torch.Tensor,
                   after: torch.Tensor) -> Optional[tuple[str, str]]:
    """(what, hint) when cache ``name`` does not hold exactly what it should after the step, else None."""
    if torch.allclose(got, after, atol=1e-5, rtol=1e-5):  # the new slot: one product of x and w, in any order
        return None
    length = case["length"]
    new = after[:, :, length]
    if torch.equal(got, before):
        return (f"{name} is unchanged: the new token's key and value were not stored",
                "the next decode step reads this token from the cache: write it in place (a slice assignment)")
    if length > 0 and torch.allclose(got[:, :, length - 1], new):
        return (f"{name}: the new token went into slot length-1, over the last cached token",
                "slots 0 .. length-1 are taken; which slot is free?")
    if length + 1 < got.shape[2] and torch.allclose(got[:, :, length + 1], new):
        return f"{name}: the new token went into slot length+1", "slots are counted from 0"
    return (f"{name} does not hold what it should after the step", "only slot `length` changes: it gets the new "
            "token's key (or value), one vector per KV head")


def check_gqa_decode_step(fn: Any) -> CheckResult:
    """Check ``gqa_decode_step`` against Hugging Face's ``LlamaAttention`` on 4 shapes (2 of them grouped)."""
    name = "gqa_decode_step"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    for index, shape in enumerate(_GQA_CASES):
        case, label = _gqa_case(index), repr(_label(shape))
        k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
        try:
            with torch.no_grad():
                got = fn(case["x"].clone(), *[w.clone() for w in case["weights"]], k_cache, v_cache, case["length"])
        except Exception as error:  # the student's bug, reported with its case
            return failed(name, label, f"raised {type(error).__name__}: {error}")
        if got is None:
            return failed(name, label, "returned None: return the output (batch, hidden)")
        got = torch.as_tensor(got).detach().float()
        expected = case["expected"]
        if got.numel() != expected.numel():
            return failed(name, label, f"returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}",
                          "one output vector per request, after the output projection wo")
        got = got.reshape(expected.shape)
        for cache_name, before, now, after in (("k_cache", case["k_cache"], k_cache, case["after_k"]),
                                               ("v_cache", case["v_cache"], v_cache, case["after_v"])):
            mistake = _cache_mistake(case, cache_name, before, now, after)
            if mistake:
                return failed(name, label, *mistake)
        if not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
            return failed(name, label, *_output_mistake(case, got))
    return passed(name, f"{len(_GQA_CASES)} cases against Hugging Face's LlamaAttention (grouped, multi-query "
                  "and multi-head; the caches and the output)")


# ----------------------------------------------------------------------------- the cache's write and read

# (batch, heads, max_len, head_dim, lengths)
_STEP_CASES = ((3, 2, 8, 4, (3, 5, 1)), (2, 1, 6, 2, (4, 4)), (4, 2, 9, 3, (2, 7, 1, 5)))


def _step_case(index: int) -> dict[str, Any]:
    """Case ``index``: what the student gets, and what the library's KVCache and Group make of it."""
    batch, heads, max_len, head_dim, lengths = _STEP_CASES[index]
    g = torch.Generator().manual_seed(50 + index)
    k_cache, v_cache = (torch.randn(batch, heads, max_len, head_dim, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(batch, heads, 1, head_dim, generator=g) for _ in range(2))
    # the library's plan of the first decode step for prompts of these lengths, and its cache
    group = Group([Request(tuple([1] * n), max_new_tokens=2) for n in lengths], list(range(batch)))
    step = group.decode(1, torch.zeros(batch, dtype=torch.long))
    cache = KVCache([0], batch, heads, max_len, head_dim)
    cache.k[0].copy_(k_cache)
    cache.v[0].copy_(v_cache)
    cache.write(0, step.slots, k_new, v_new)
    k, v = cache.read(0, batch, step.upto)
    return dict(args=(k_cache, v_cache, k_new, v_new, torch.tensor(lengths)), after=(cache.k[0], cache.v[0]),
                read=(k, v), mask=step.mask.reshape(batch, step.upto), lengths=lengths)


def _written_at(case: dict[str, Any], slots: torch.Tensor) -> torch.Tensor:
    """The K cache after writing the new keys at ``slots`` (b,), by the library's write."""
    k_cache, _, k_new, v_new, _ = case["args"]
    batch, heads, max_len, head_dim = k_cache.shape
    cache = KVCache([0], batch, heads, max_len, head_dim)
    cache.k[0].copy_(k_cache)
    cache.write(0, slots.view(-1, 1), k_new, v_new)
    return cache.k[0]


def _write_mistake(case: dict[str, Any], got: torch.Tensor) -> tuple[str, str]:
    lengths = torch.tensor(case["lengths"])
    if torch.equal(got, case["args"][0]):
        return ("k_cache is unchanged: the new keys were not stored",
                "the next step reads them from the cache: write in place (index assignment into k_cache)")
    if torch.equal(got, _written_at(case, lengths - 1)):
        return ("each row's new key went into slot lengths[b]-1, over its last token", "slots 0 .. lengths[b]-1 "
                "are taken; which one is free?")
    for slot in (int(lengths.max()), int(lengths[0]), int(lengths.min())):
        if torch.equal(got, _written_at(case, torch.full_like(lengths, slot))):
            return ("every row's new key went into the same slot", "the rows have different lengths, so each has its "
                    "own next free slot")
    return "k_cache does not hold what it should after the step", "only one slot per row changes"


def _as_mask(value: Any, batch: int) -> torch.Tensor:
    mask = torch.as_tensor(value)
    if mask.dtype != torch.bool:
        raise TypeError(f"a bool mask (True where a query may attend), not {mask.dtype}")
    return mask.reshape(batch, -1)


def check_cache_step(fn: Any) -> CheckResult:
    """Check ``cache_step`` against the library's ``KVCache.write``/``read`` and ``Group.decode``'s mask (3 batches)."""
    name = "cache_step"
    require_callable(fn, name)
    if is_stub(fn):
        return stub_result(name, name)
    for index, shape in enumerate(_STEP_CASES):
        case = _step_case(index)
        label = repr(f"lengths {list(shape[4])}, max_len {shape[2]}")
        k_cache, v_cache, k_new, v_new, lengths = (t.clone() for t in case["args"])
        try:
            out = fn(k_cache, v_cache, k_new, v_new, lengths)
            k, v, mask = out
            mask = _as_mask(mask, len(shape[4]))
        except Exception as error:  # the student's bug (or a wrong return), with its case
            return failed(name, label, f"{type(error).__name__}: {error}",
                          "return the three values (k, v, mask)" if "unpack" in str(error) else "")
        for cache_name, now, after in (("k_cache", k_cache, case["after"][0]), ("v_cache", v_cache, case["after"][1])):
            if not torch.equal(now, after):
                what, hint = _write_mistake(case, k_cache) if cache_name == "k_cache" else (
                    "v_cache does not hold what it should after the step", "the values go where the keys go")
                return failed(name, label, what, hint)
        want_k, want_v = case["read"]
        upto = want_k.shape[2]
        for got, want, which in ((torch.as_tensor(k), want_k, "k"), (torch.as_tensor(v), want_v, "v")):
            if got.shape != want.shape:
                hint = ("the longest row's new token sits in slot max(lengths): it must be read too"
                        if got.dim() == 4 and got.shape[2] == upto - 1 else
                        f"read the slots up to the longest row only (upto = {upto} here), not the whole cache"
                        if got.dim() == 4 and got.shape[2] == shape[2] else "")
                return failed(name, label, f"{which} has shape {tuple(got.shape)}, expected {tuple(want.shape)}", hint)
            if not torch.equal(got, want):
                return failed(name, label, f"{which} is not the cache's slots 0 .. {upto - 1}", "read after writing")
        want_mask = case["mask"]
        if mask.shape != want_mask.shape:
            return failed(name, label, f"mask has shape {tuple(mask.shape)}, expected {tuple(want_mask.shape)}",
                          "one row per request, one column per slot read")
        if not torch.equal(mask, want_mask):
            if bool((mask & ~want_mask).any()):
                what, hint = ("a shorter row may attend slots it never filled",
                              "row b has written slots 0 .. lengths[b] only; the rest of its row is padding")
            else:
                what, hint = ("the new token may not attend to itself", "the new token's own slot is lengths[b]")
            return failed(name, label, what, hint)
    return passed(name, f"{len(_STEP_CASES)} batches of different lengths, against the library's KVCache and "
                  "Group.decode")

