"""The training loop every chapter shares: weighted loss, one step, a record of each step.

The source article's loop is a sketch (no imports, no ``processes`` list, no loss on
target tokens only). This one is complete and small enough to read in one sitting:

    for each batch:  zero_grad -> forward -> loss -> backward
                     -> average_gradients_fn(model)   # data parallel: all-reduce here
                     -> optimizer.step()

and it measures what the chapters compare: per step, the number of target tokens, the
seconds the step took and so tokens per second, plus the loss. **Tokens** here always
means target tokens, the sum of ``label_token_weights`` (English tokens incl. their final
eos): the tokens the loss is averaged over, so tokens/s is comparable between runs that
pad differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from parallel_lib.common.timeline import DeviceClock

__all__ = ["TrainRecord", "weighted_cross_entropy", "forward_loss", "train", "evaluate", "busy_machine_warning"]

Batch = Mapping[str, Any]  # {"input_ids", "labels", "label_token_weights"} as from text.collate_batch


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                           denominator: float | torch.Tensor | None = None) -> torch.Tensor:
    """Token-weighted cross-entropy: ``sum(ce * weights) / sum(weights)``.

    ``labels`` are already shifted (``labels[:, t]`` is the token after ``input_ids[:, t]``),
    so nothing is shifted here. A batch without weight gives 0, not NaN.

    Args:
        logits: (B, T, V) scores.
        labels: (B, T) token ids.
        weights: (B, T), 1 where a token counts (targets), 0 elsewhere (source, padding).
        denominator: divide by this instead of ``sum(weights)``; with data parallelism, the
            global batch's weight makes the all-reduced (summed) losses and gradients equal
            to one process's on the whole batch.

    Raises:
        ValueError: shapes that do not match.
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape or labels.shape != weights.shape:
        raise ValueError(f"logits must be (B, T, V) and labels, weights (B, T), got logits {tuple(logits.shape)}, "
                         f"labels {tuple(labels.shape)}, weights {tuple(weights.shape)}")
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")  # (B*T,)
    w = weights.flatten().to(ce.dtype)
    total = w.sum() if denominator is None else torch.as_tensor(denominator, dtype=ce.dtype, device=ce.device)
    return (ce * w).sum() / total.clamp_min(torch.finfo(ce.dtype).tiny)


def forward_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``model(input_ids)`` -> weighted cross-entropy on the batch's shifted labels.

    Works with a Hugging Face model (``.logits`` of its output; no ``labels`` are passed,
    so it does not shift again) and with any module that returns the logits tensor itself.
    """
    output = model(batch["input_ids"])
    logits = getattr(output, "logits", output)
    return weighted_cross_entropy(logits, batch["labels"], batch["label_token_weights"])


@dataclass
class TrainRecord:
    """What a training loop measured, one entry per step: the one timed-step record of the course.

    ``train``, data-parallel ranks (their own steps, and the job's), the measured comparison
    and the benchmarks all produce it, and read it back through :meth:`throughput` and
    :meth:`summary`, so "tokens per second after warm-up" is computed in one place.
    Picklable: ranks return it from ``launch``.

    Attributes:
        losses: the loss of each step (a mean over target tokens).
        tokens: target tokens of each step.
        step_times: seconds of each step, forward to optimizer step, devices synchronised.
        tokens_per_sec: ``tokens / step_times`` of each step.
        phases: seconds of each step by phase, e.g. ``{"compute": [...], "sync": [...]}``;
            every phase has one entry per step (empty when the loop did not split its steps).
    """

    losses: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens_per_sec: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def append(self, loss: float, tokens: int, seconds: float, phases: Optional[Mapping[str, float]] = None) -> None:
        """Record one step; ``phases`` (seconds by phase name) must name the same phases at every step.

        Raises:
            ValueError: ``phases`` names other phases than the steps before.
        """
        phases = dict(phases or {})
        if self.steps and set(phases) != set(self.phases):
            raise ValueError(f"phases must name the same phases at every step: {sorted(self.phases)} so far, "
                             f"got {sorted(phases)} at step {self.steps}")
        self.losses.append(loss)
        self.tokens.append(tokens)
        self.step_times.append(seconds)
        self.tokens_per_sec.append(tokens / seconds if seconds > 0 else float("inf"))
        for name, value in phases.items():
            self.phases.setdefault(name, []).append(value)

    def extend(self, other: TrainRecord) -> None:
        """Append every step of ``other`` (e.g. the next epoch)."""
        for k in range(other.steps):
            self.append(other.losses[k], other.tokens[k], other.step_times[k],
                        {name: values[k] for name, values in other.phases.items()})

    @classmethod
    def from_steps(cls, losses: Sequence[float], tokens: Sequence[int], step_times: Sequence[float],
                   phases: Optional[Mapping[str, Sequence[float]]] = None) -> TrainRecord:
        """A record from per-step lists, e.g. a job's view built from every rank's records.

        Raises:
            ValueError: lists of different lengths.
        """
        phases = dict(phases or {})
        lengths = dict(losses=len(losses), tokens=len(tokens), step_times=len(step_times),
                       **{f"phases[{name!r}]": len(values) for name, values in phases.items()})
        if len(set(lengths.values())) > 1:
            raise ValueError(f"every list needs one entry per step, got lengths {lengths}")
        record = cls()
        for k in range(len(losses)):
            record.append(losses[k], tokens[k], step_times[k], {name: v[k] for name, v in phases.items()})
        return record

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def total_time(self) -> float:
        return sum(self.step_times)

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    def throughput(self, skip: int = 0) -> float:
        """Target tokens per second over all steps but the first ``skip`` (warm-up).

        NaN when no step is left after the warm-up: :meth:`describe_throughput` says so in words.
        """
        tokens, seconds = sum(self.tokens[skip:]), sum(self.step_times[skip:])
        return tokens / seconds if seconds > 0 else float("nan")

    def describe_throughput(self, skip: int = 0) -> str:
        """:meth:`throughput` as text, or why there is none (a run no longer than its warm-up)."""
        if self.steps <= skip:
            return (f"not measured: the run has {self.steps} step{'s' * (self.steps != 1)} and the first {skip} "
                    f"are warm-up; run more than {skip} steps")
        return f"{self.throughput(skip):,.1f} target tokens/s (steps {skip}..{self.steps - 1})"

    def summary(self, warmup: int = 0) -> dict[str, float]:
        """Steps, target tokens, seconds, tokens/s after ``warmup`` steps and the final loss."""
        return {"steps": self.steps, "tokens": self.total_tokens, "seconds": self.total_time,
                "tokens_per_sec": self.throughput(skip=warmup), "final_loss": self.final_loss}


def _to_device(batch: Batch, device: torch.device | str | None) -> Batch:
    if device is None:
        return batch
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[Batch], desc: str = "train",
          average_gradients_fn: Callable[[torch.nn.Module], None] | None = None,
          device: torch.device | str | None = None, progress: bool = True, max_steps: int | None = None
          ) -> TrainRecord:
    """Train ``model`` for one pass over ``batches`` (or ``max_steps`` of them).

    Args:
        model: returns logits (or an output with ``.logits``) for ``input_ids``.
        optimizer: over ``model``'s parameters.
        batches: dicts from ``parallel_lib.data.collate_batch`` (e.g. a DataLoader).
        desc: label of the progress bar.
        average_gradients_fn: called as ``fn(model)`` after ``backward`` and before
            ``optimizer.step()``, e.g. the data-parallel all-reduce of the gradients.
        device: where to move each batch (None: leave it where it is).
        progress: show a tqdm bar with loss and tokens/s (pass ``rank == 0`` in ranks).
        max_steps: stop after this many steps.

    Returns:
        The per-step ``TrainRecord``, each step split into phases: "compute" (forward and
        backward), "sync" (``average_gradients_fn``) and "optimizer". Every clock read first
        waits for the devices that hold the model's parameters, so on GPUs a step's time is
        when its kernels ran, not when they were queued.

    Raises:
        ValueError: ``max_steps`` negative.
    """
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0):
        raise ValueError(f"max_steps must be a non-negative int or None, got max_steps={max_steps!r}")
    total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    if max_steps is not None:
        batches, total = islice(batches, max_steps), max_steps if total is None else min(total, max_steps)
    model.train()
    record = TrainRecord()
    # a clock read waits for the devices holding the model's parameters, and only those (per
    # device: another program's GPU is not this loop's business); CPU devices have nothing queued
    clock = DeviceClock(p.device for p in model.parameters())
    with tqdm(batches, desc=desc, total=total, disable=not progress, leave=False) as bar:
        for batch in bar:
            tokens = int(batch["label_token_weights"].sum().item())  # before the move: no device sync
            batch = _to_device(batch, device)
            start = clock()
            optimizer.zero_grad(set_to_none=True)
            loss = forward_loss(model, batch)
            loss.backward()
            computed = clock()
            if average_gradients_fn is not None:
                average_gradients_fn(model)
            synced = clock()
            optimizer.step()
            end = clock()
            loss_value = loss.item()
            record.append(loss_value, tokens, end - start,
                          {"compute": computed - start, "sync": synced - computed, "optimizer": end - synced})
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record.tokens_per_sec[-1]:,.0f}", refresh=False)
    return record


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device | str | None = None) -> float:
    """Mean loss per target token over all ``batches`` (not a mean of batch means).

    The model is put in eval mode and restored to its previous mode afterwards.

    Raises:
        ValueError: the batches hold no target token.
    """
    was_training = model.training
    model.eval()
    loss_sum, weight_sum = 0.0, 0.0
    try:
        for batch in batches:
            batch = _to_device(batch, device)
            weight = batch["label_token_weights"].sum()
            loss_sum += (forward_loss(model, batch) * weight).item()
            weight_sum += weight.item()
    finally:
        model.train(was_training)
    if weight_sum == 0:
        raise ValueError("batches must hold at least one target token (label_token_weights all 0 or no batches)")
    return loss_sum / weight_sum


def busy_machine_warning(ceiling: float, workers: int, threshold: float = 0.75) -> str:
    """A warning when ``workers`` with nothing to share ran below ``threshold * workers`` x one worker.

    Scaling numbers on a laptop are only meaningful when the cores are free. The ceiling run (the
    same work on every worker with no communication at all) is the check: if even it falls far
    short of ``workers`` x, other programs hold the cores and every ratio printed beside it
    measures the machine's load, not the parallel strategy. Returns "" when the ceiling is fine.
    """
    if ceiling >= threshold * workers:
        return ""
    return (f"Warning: {workers} workers with no communication at all ran only {ceiling:.2f}x as fast as one "
            f"(expected about {workers}x): other programs are using the cores, so the ratios here measure the "
            "machine's load. Close them (or wait) and run again.")
