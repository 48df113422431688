"""Running a layout of :func:`~parallel_lib.training.run.train` from a notebook or a benchmark, and reading it.

- :func:`train_layout` starts the plan's ranks (gloo, NCCL with a GPU each) and returns every
  rank's :class:`~parallel_lib.training.run.TrainResult`; :func:`train_3d` is the same for a
  DP × TP × PP grid given as three numbers (chapter 10);
- :func:`measure_layout` is what the planner's check calls: step time, model-state bytes per
  rank and traffic per mesh axis, for one layout (:func:`summarize_layout` from results);
- :func:`job_record` is the job's loss, tokens and step times as one process would record them;
- :func:`max_difference` compares the ranks' parameters with the one single-process
  :func:`~parallel_lib.training.one_process.reference`.
"""

from __future__ import annotations

import statistics
from dataclasses import fields as dataclass_fields
from typing import Any, NamedTuple, Sequence

import torch

from parallel_lib.common.compare import max_abs_difference
from parallel_lib.common.training import TrainRecord
from parallel_lib.runtime.launcher import launch
from parallel_lib.training.plan import Plan
from parallel_lib.training.run import RunConfig, TrainResult, check_layout, train

__all__ = ["train_layout", "train_3d", "LayoutMeasurement", "measure_layout", "summarize_layout", "max_difference",
           "job_step_times", "job_record", "split_fields"]


def train_layout(plan: Plan, run: RunConfig = RunConfig(), timeout: float = 300.0,
                 startup_timeout: float = 300.0) -> list[TrainResult]:
    """Train ``plan`` on ``plan.mesh.world_size`` new ranks, one thread each.

    ``startup_timeout`` is generous: eight ranks each importing torch and transformers on two
    shared cores take a minute.

    Returns:
        One :class:`~parallel_lib.training.run.TrainResult` per rank, in rank order.

    Raises:
        ValueError: a plan or run that cannot work (before any rank starts).
        RankError: a rank failed (its message names the rank and its coordinates).
    """
    check_layout(plan, run)
    return launch(train, plan.mesh.world_size, plan, run, threads_per_rank=1, timeout=timeout,
                  startup_timeout=startup_timeout)


def split_fields(**fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort keyword arguments into :class:`Plan`'s and :class:`RunConfig`'s fields.

    Raises:
        TypeError: a name that is a field of neither (named).
    """
    plan_names = {f.name for f in dataclass_fields(Plan)}
    run_names = {f.name for f in dataclass_fields(RunConfig)}
    unknown = sorted(set(fields) - plan_names - run_names)
    if unknown:
        raise TypeError(f"{unknown} are fields of neither Plan nor RunConfig; Plan has {sorted(plan_names)}, "
                        f"RunConfig {sorted(run_names)}")
    return ({k: v for k, v in fields.items() if k in plan_names}, {k: v for k, v in fields.items() if k in run_names})


def train_3d(dp: int, tp: int, pp: int, model: str = "tiny", steps: int = 2, timeout: float = 300.0,
             startup_timeout: float = 300.0, **fields: Any) -> list[TrainResult]:
    """:func:`train_layout` of ``Plan(dp, tp, pp, ...)``; ``fields`` are any other Plan or RunConfig fields.

    ``timeout`` and ``startup_timeout`` are the launch's (RunConfig's own ``timeout``, how long
    one receive or collective may wait, keeps its default).

    Raises:
        TypeError: a field of neither dataclass.
        ValueError, RankError: as :func:`train_layout`.
    """
    plan_fields, run_fields = split_fields(**fields)
    return train_layout(Plan(dp=dp, tp=tp, pp=pp, **plan_fields), RunConfig(model=model, steps=steps, **run_fields),
                        timeout, startup_timeout)


def job_step_times(results: Sequence[TrainResult]) -> list[float]:
    """Seconds of each step of the job: a step lasts as long as its slowest rank."""
    return [max(times) for times in zip(*(r.record.step_times for r in results))]


def job_record(results: Sequence[TrainResult]) -> TrainRecord:
    """The job's record, as one process would have kept it: per step the global token-mean loss, the
    global batch's target tokens and the slowest rank's seconds (``.throughput(skip)``: tokens/s).

    The loss is the sum of the last stage's shares (tensor slice 0) over the replicas (and their
    cp and ep ranks: ``Plan.replicas``).

    Raises:
        ValueError: ``results`` hold no last-stage rank of tensor slice 0 (not every rank's result).
    """
    plan = results[0].plan
    last = [r for r in results if r.coords["pp"] == plan.pp - 1 and r.coords["tp"] == 0]
    if len(last) != plan.replicas:
        raise ValueError(f"job_record needs every rank's result: got {len(last)} of the {plan.replicas} last-stage "
                         "ranks of tensor slice 0")
    return TrainRecord.from_steps(losses=[sum(step) for step in zip(*(r.record.losses for r in last))],
                                  tokens=results[0].record.tokens, step_times=job_step_times(results))


class LayoutMeasurement(NamedTuple):
    """What :func:`measure_layout` returns; unpacks as ``(step_seconds, model_state_bytes, traffic, results)``."""

    step_seconds: float                       # median over steps after warm-up of the slowest rank's step
    model_state_bytes: int                    # the fullest rank's parameters + gradients + optimizer states
    traffic: dict[str, float]                 # bytes the busiest rank sends per step, by mesh axis
    results: list[TrainResult]                # every rank's result, for anything else


def measure_layout(dp: int, tp: int, pp: int, model: str = "tiny", steps: int = 4, warmup: int = 1,
                   **fields: Any) -> LayoutMeasurement:
    """Run one layout for ``steps`` steps and measure it (the planner's check calls this per layout).

    ``fields`` are :func:`train_3d`'s (``micro_batches``, ``schedule``, ``recompute``, ``zero``,
    ``batch_size``, ``seq_len``, ``vocab_size``, ``n_layer``, ``n_embd``, ...). Traffic axes:
    "tp" (the stage's tensor-parallel all-reduces), "pp" (activations and gradients sent
    to neighbouring stages), "dp" (ZeRO's gradient and parameter collectives), "tied" (the
    embedding's two copies). The ranks return no parameters (``return_state=False``).

    Raises:
        ValueError: ``warmup`` leaves no step to time, or a layout that does not fit.
    """
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup must be in [0, steps={steps}) so that a step is left to time, got warmup={warmup}")
    fields.setdefault("return_state", False)
    return summarize_layout(train_3d(dp, tp, pp, model=model, steps=steps, **fields), warmup)


def summarize_layout(results: Sequence[TrainResult], warmup: int = 1) -> LayoutMeasurement:
    """:func:`measure_layout`'s numbers from every rank's result (the busiest or fullest rank, the slowest step)."""
    results = list(results)
    kinds = {kind for r in results for kind in r.wire}
    traffic = {kind: max(r.wire.get(kind, 0.0) for r in results) for kind in sorted(kinds)}
    return LayoutMeasurement(statistics.median(job_step_times(results)[warmup:]),
                             max(r.state_bytes for r in results), traffic, results)


def max_difference(results: Sequence[TrainResult], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest absolute difference per parameter name over every replica's ranks that hold it (``inf``: not finite).

    Raises:
        ValueError: no rank returned parameters (run with ``return_state=True``), or a parameter of
            the reference that no stage holds.
    """
    differences: dict[str, float] = {}
    for r in results:
        for name, tensor in r.state.items():
            diff = max_abs_difference(tensor, reference[name])  # inf for a NaN or an infinity: never passes
            differences[name] = max(differences.get(name, 0.0), diff)
    if not differences:
        raise ValueError("results hold no parameters: run with return_state=True")
    trainable = {k for k in reference if k != "lm_head.weight" and not k.endswith((".attn.bias", "masked_bias"))}
    missing = sorted(trainable - set(differences))
    if missing:
        raise ValueError(f"no stage returned the reference's parameters {missing}")
    return differences
