"""Chapter 13's GPU check: the paged, continuously batched engine on ``cuda:0`` gives Hugging Face's greedy tokens.

:mod:`parallel_lib.gpu_checks` registers :func:`check_serving` as ``serving``. A GPT-2 with a wide
initialisation (its greedy tokens vary; GPT-2's 0.02 mostly repeats one) goes to ``cuda:0``, and a
mixed batch of requests (prompts of 2 to 24 tokens, outputs of 2 to 12 or 40) more numerous than
the engine's batch, so requests join as others finish, is served greedily by
:class:`~parallel_lib.serving.ServingEngine`, its KV pool on the same device: continuous batching,
with chunked prefill, and with speculative decoding (a draft of the target's first layer). Every
request's tokens must equal Hugging Face ``generate`` of the same model on the same device, each
request alone.

The times come from CUDA events recorded on the device's stream around each run
(:class:`~parallel_lib.common.timeline.TimelineRecorder` built with the device), read after the
runs; nothing synchronises the device to take a time. On a machine without a GPU,
``python -m parallel_lib.check_gpu --only serving`` checks nothing and says so; with ``--allow-cpu``
the same code runs on the CPU, timed by the host clock.
"""

from __future__ import annotations

import random

import torch

from parallel_lib.common.tables import markdown_table
from parallel_lib.common.timeline import TimelineRecorder
from parallel_lib.gpu_checks._reference import CheckError, free_memory
from parallel_lib.inference import Request, ServeConfig
from parallel_lib.runtime.device import resolve_device
from parallel_lib.serving import ServingEngine, blocks_for, draft_from_target

__all__ = ["serving_requests", "check_serving"]

BLOCK_SIZE, MAX_BATCH, K = 8, 8, 4


def serving_requests(quick: bool, vocab_size: int = 97) -> list[Request]:
    """The check's seeded greedy requests: 12 (quick) or 32, prompts of 2 to 24 tokens, outputs of 2 to 12 or 40."""
    rng = random.Random(13)
    n, longest = (12, 12) if quick else (32, 40)
    return [Request([rng.randrange(vocab_size) for _ in range(rng.randint(2, 24))], rng.randint(2, longest))
            for _ in range(n)]


def _hf_greedy(model, requests: list[Request], device: torch.device) -> list[list[int]]:
    """Hugging Face ``generate``, greedy, each request alone on ``device``."""
    out = []
    for r in requests:
        ids = torch.tensor([list(r.prompt)], device=device)
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens,
                             do_sample=False, pad_token_id=0)
        out.append(got[0, len(r.prompt):].tolist())
    return out


def check_serving(n_gpus: int, quick: bool = False) -> str:
    """Chapter 13: the serving engine on ``cuda:0`` (continuous, chunked, speculative) vs Hugging Face ``generate``.

    Raises:
        CheckError: a request got other tokens than Hugging Face's, the pool is not on the model's device,
            or no request joined the batch while others decoded.
    """
    device = resolve_device(0)
    serve = ServeConfig(model="tiny" if quick else "small", initializer_range=0.3)
    model = serve.build().to(device)
    requests = serving_requests(quick, serve.vocab_size)
    recorder = TimelineRecorder(device=device)  # CUDA events on the device's stream; the host clock on a CPU
    with recorder.record("hf", "decode"):
        expected = _hf_greedy(model, requests, device)
    if len({t for tokens in expected for t in tokens}) < 5:
        raise CheckError("the model repeats a few tokens only: the comparison would prove little")
    # a pool for half the batch's longest requests: sequences are preempted and recomputed when it runs short
    num_blocks = MAX_BATCH * blocks_for(max(r.slots for r in requests) + K, BLOCK_SIZE) // 2
    engines = {"continuous batching": {}, "+ chunked prefill (16 tokens/step)": dict(max_step_tokens=16),
               f"+ speculative decoding (k={K}, draft: first layer)": dict(draft=draft_from_target(model, 1), k=K)}
    served = {}
    for name, options in engines.items():
        engine = ServingEngine(model, num_blocks, BLOCK_SIZE, MAX_BATCH, **options)
        if engine.cache.k[0].device != device:
            raise CheckError(f"{name}: the KV pool is on {engine.cache.k[0].device}, the model on {device}")
        with recorder.record(name, "decode"):
            results = engine.run(requests)
        wrong = [i for i, (r, want) in enumerate(zip(results, expected)) if r.tokens != want]
        if wrong:
            i = wrong[0]
            raise CheckError(f"{name} on {device}: {len(wrong)} of {len(requests)} requests got other tokens than "
                             f"Hugging Face generate, e.g. request {i}: {results[i].tokens} vs {expected[i]}")
        if not any(r.admitted and r.decode for r in engine.records):
            raise CheckError(f"{name}: no request joined the batch while others decoded (no continuous batching)")
        served[name] = (engine, results)
    seconds = {e.lane: e.duration for e in recorder.resolve()}  # read once the runs are done
    tokens = sum(len(t) for t in expected)
    rows = [["Hugging Face generate, one request at a time", f"{len(requests)}/{len(requests)}", "-", "-",
             f"{tokens / seconds['hf']:,.0f}", "-", "-"]]
    for name, (engine, results) in served.items():
        ttft = sorted(r.ttft for r in results)[len(results) // 2]
        tpot = sorted(r.tpot for r in results if len(r.tokens) > 1)
        spec = engine.drafter.stats if engine.drafter is not None else None
        rows.append([name, f"{len(requests)}/{len(requests)}", engine.steps, engine.preemptions,
                     f"{tokens / seconds[name]:,.0f}", f"{1e3 * ttft:.1f} / {1e3 * tpot[len(tpot) // 2]:.2f}",
                     f"{100 * spec.acceptance_rate:.0f} %" if spec else "-"])
    free_memory()
    return "\n".join([f"Serving GPT-2 {serve.model} (initializer range 0.3) on {device}: {len(requests)} greedy "
                      f"requests, max_batch {MAX_BATCH}, {num_blocks} blocks of {BLOCK_SIZE}; every engine's tokens "
                      f"equal Hugging Face generate's on the same device:", "",
                      markdown_table(["engine", "same tokens as HF", "steps", "preemptions", "tokens/s",
                                      "TTFT / TPOT median ms", "acceptance"], rows, "lrrrrrr")])
