"""Running a DP × TP × PP layout from a notebook or a benchmark, and the one-process run it must equal.

- :func:`train_3d` starts ``dp·tp·pp`` gloo ranks (NCCL with a GPU each) and returns every rank's
  :class:`~parallel_lib.hybrid.dp_tp_pp.Result3D`;
- :func:`measure_layout` is what the planner's check calls: step time, model-state bytes per
  rank and traffic per group, for one layout;
- :func:`reference_3d` trains Hugging Face's dense GPT-2 in one process on the same global
  batches, and :func:`max_difference` compares the ranks' parameters with it.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from parallel_lib.common.models import build_gpt2
from parallel_lib.hybrid.dp_tp_pp import Config3D, Result3D, batches_3d, model_overrides, run_3d
from parallel_lib.runtime.launcher import launch

__all__ = ["train_3d", "LayoutMeasurement", "measure_layout", "summarize_layout", "reference_3d", "max_difference",
           "job_step_times"]


def train_3d(dp: int, tp: int, pp: int, model: str = "tiny", steps: int = 2, micro_batches: int = 2,
             schedule: str = "1f1b", recompute: bool = False, timeout: float = 300.0,
             startup_timeout: float = 300.0, **fields: Any) -> list[Result3D]:
    """Train GPT-2 on ``dp·tp·pp`` new ranks; ``fields`` are any other :class:`Config3D` fields.

    ``startup_timeout`` is generous: eight ranks each importing torch and transformers on two
    shared cores take a minute.

    Returns:
        One :class:`Result3D` per rank, in rank order.

    Raises:
        ValueError: a layout that does not fit the model or the batch (before any rank starts).
        RankError: a rank failed (its message names the rank and its coordinates).
    """
    config = Config3D(dp=dp, tp=tp, pp=pp, model=model, steps=steps, micro_batches=micro_batches,
                      schedule=schedule, recompute=recompute, **fields)
    config.check()
    return launch(run_3d, config.mesh.world_size, config, threads_per_rank=1, timeout=timeout,
                  startup_timeout=startup_timeout)


def job_step_times(results: Sequence[Result3D]) -> list[float]:
    """Seconds of each step of the job: a step lasts as long as its slowest rank."""
    return [max(r.step_times[k] for r in results) for k in range(len(results[0].step_times))]


class LayoutMeasurement(NamedTuple):
    """What :func:`measure_layout` returns; unpacks as ``(step_seconds, model_state_bytes, traffic)``."""

    step_seconds: float                       # median over steps after warm-up of the slowest rank's step
    model_state_bytes: int                    # the fullest rank's parameters + gradients + optimizer states
    traffic: dict[str, float]                 # bytes the busiest rank sends per step, by group kind
    results: list[Result3D]                   # every rank's result, for anything else


def measure_layout(dp: int, tp: int, pp: int, model: str = "tiny", steps: int = 4, warmup: int = 1,
                   **fields: Any) -> LayoutMeasurement:
    """Run one layout for ``steps`` steps and measure it (the planner's check calls this per layout).

    ``fields`` are :func:`train_3d`'s (``micro_batches``, ``schedule``, ``recompute``, ``optimizer``,
    ``batch_size``, ``seq_len``, ``vocab_size``, ``n_layer``, ``n_embd``, ...). Traffic kinds:
    "tp" (all-reduces of the stage's tensor-parallel group), "pp" (activations and gradients sent
    to neighbouring stages), "dp" (the gradient all-reduce), "tied" (the embedding's two copies).

    Raises:
        ValueError: ``warmup`` leaves no step to time, or a layout that does not fit.
    """
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup must be in [0, steps={steps}) so that a step is left to time, got warmup={warmup}")
    return summarize_layout(train_3d(dp, tp, pp, model=model, steps=steps, **fields), warmup)


def summarize_layout(results: Sequence[Result3D], warmup: int = 1) -> LayoutMeasurement:
    """:func:`measure_layout`'s numbers from every rank's result (the busiest or fullest rank, the slowest step)."""
    results = list(results)
    kinds = {kind for r in results for kind in r.wire}
    traffic = {kind: max(r.wire.get(kind, 0.0) for r in results) for kind in sorted(kinds)}
    return LayoutMeasurement(statistics.median(job_step_times(results)[warmup:]),
                             max(r.state_bytes for r in results), traffic, results)


def reference_3d(config: Config3D) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, Hugging Face's dense GPT-2, the whole global batch: the losses and parameters to match.

    Independent of the tensor-parallel code: the model's own forward (causal attention), its
    own tied head, the course's weighted loss ``sum(ce · w) / sum(w)``.
    """
    model = build_gpt2(config.model, config.vocab_size, config.seed, **model_overrides(config))
    model.train()
    optimizer = (torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD)(model.parameters(),
                                                                                       lr=config.lr)
    losses = []
    for batch in batches_3d(replace(config, return_state=False)):
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"]).logits
        ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        weights = batch["label_token_weights"].flatten()
        loss = (ce * weights).sum() / weights.sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_difference(results: Sequence[Result3D], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest absolute difference per parameter name over every replica's ranks that hold it.

    Raises:
        ValueError: no rank returned parameters (run with ``return_state=True``), or a parameter of
            the reference that no stage holds.
    """
    differences: dict[str, float] = {}
    for r in results:
        for name, tensor in r.state.items():
            diff = (tensor - reference[name]).abs().max().item()
            differences[name] = max(differences.get(name, 0.0), diff)
    if not differences:
        raise ValueError("results hold no parameters: run with return_state=True")
    missing = sorted({name for name, _ in _named_parameters(reference)} - set(differences))
    if missing:
        raise ValueError(f"no stage returned the reference's parameters {missing}")
    return differences


def _named_parameters(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The trainable entries of a GPT-2 state dict (the tied head is the embedding: left out)."""
    return [(k, v) for k, v in state.items() if k != "lm_head.weight" and not k.endswith(".attn.bias")
            and not k.endswith("masked_bias")]
