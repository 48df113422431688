"""The process engine: one rank per pipeline rank over gloo (NCCL on GPUs), any schedule.

Each rank builds the same model from the same seed, keeps the model stages the schedule's
placement gives it, and runs its action list. Between two actions it exchanges, in ONE
``batch_isend_irecv`` (:class:`~parallel_lib.pipeline_parallel.link.StageLink`), what the last
action produced and what the next one needs; a neighbour stage on the same rank (the turn of a
V) is a hand-over in memory. That is deadlock-free exactly when
:func:`~parallel_lib.pipeline_parallel.hangs.check_blocking` accepts the schedule (GPipe, 1F1B,
ZB-H1, ZB-H2; gloo's sends block like NCCL's large ones, as the run confirms). Interleaved and V
schedules need ``deferred_sends``: every send is posted on its own (``dist.isend``) and waited
for at the end of the step, while receives are waited for when needed, as
``torch.distributed.pipelining`` does. Receives follow the sender's order on each channel
(``exchange_plan(..., sender_order=True)``), so a V schedule's activations and gradients that
share a channel are never taken for one another.

:func:`run_pipeline_rank` is the worker for :func:`parallel_lib.runtime.launcher.launch`; it
returns the rank's loss share and its parameters' gradients, by the unsplit model's names, so
a test can compare them with one process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallel_lib.pipeline_parallel.link import Message, StageLink, exchange_plan, wait_for
from parallel_lib.pipeline_parallel.microbatch import loss_weights, split_layers
from parallel_lib.pipeline_parallel.schedule import Action, Schedule, make_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner

__all__ = ["ProcessConfig", "mlp_and_batch", "run_pipeline_rank", "run_pipeline_ranks"]


@dataclass(frozen=True)
class ProcessConfig:
    """One training step: an MLP of ``blocks`` x (Linear(width, width), Tanh), MSE loss, ``rows`` rows."""

    schedule: str = "1f1b"
    micro_batches: int = 4
    width: int = 16
    blocks: int = 8
    rows: int = 16
    seed: int = 0
    timeout: float = 30.0
    deferred_sends: bool = False  # post sends alone and wait for them at the end of the step


def mlp_and_batch(config: ProcessConfig) -> tuple[nn.Sequential, Tensor, Tensor]:
    """The model and the batch every rank (and the one-process reference) builds alike."""
    torch.manual_seed(config.seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh())
                            for _ in range(config.blocks)])
    g = torch.Generator().manual_seed(config.seed + 1)
    return model, torch.randn(config.rows, config.width, generator=g), torch.randn(config.rows, config.width, generator=g)


def _message(schedule: Schedule, kind: str, i: int, to: int, action: Action) -> Message:
    """The message key :func:`exchange_plan` uses for a tensor for stage ``to``."""
    one = schedule.placement == tuple(range(schedule.num_stages)) and action.stage is None
    return Message(kind, i, None if one else to)  # type: ignore[arg-type]


def run_pipeline_rank(rank: int, world_size: int, config: ProcessConfig) -> dict[str, Any]:
    """Run rank ``rank``'s actions of one training step; the worker function for ``launch``."""
    torch.set_num_threads(1)
    schedule = make_schedule(config.schedule, world_size, config.micro_batches)
    model, x, y = mlp_and_batch(config)
    names = {id(p): name for name, p in model.named_parameters()}
    place = schedule.placement
    _, layers = split_layers(len(model), ["cpu"] * len(place), "layers")
    runners = {s: StageRunner(nn.Sequential(*[model[k] for k in layers[s]]), torch.device("cpu"), first=s == 0)
               for s in range(len(place)) if place[s] == rank}
    m = schedule.num_micro_batches
    xs, ys = x.tensor_split(m), y.tensor_split(m)
    weights = loss_weights([t.size(0) for t in xs], "mean")
    link = StageLink(None, None, f"rank {rank}", config.timeout, torch.device("cpu"))
    link.route = lambda message, sending: message.ranks(schedule, rank, sending)[1 if sending else 0]
    shape = lambda message: (xs[message.micro_batch].size(0), config.width)  # noqa: E731
    actions = schedule.stages[rank]
    plan = {e.before: e for e in exchange_plan(schedule, rank, paired=True, sender_order=True)}
    inbox: dict[Message, Tensor] = {}
    outbox: dict[Message, Tensor] = {}
    local: dict[tuple[str, int, int], Tensor] = {}  # hand-overs between stages of this rank
    saved: dict[tuple[int, int], Any] = {}
    for_w: dict[tuple[int, int], Any] = {}
    last, loss, split = len(place) - 1, 0.0, schedule.split_backward
    pending: list[tuple[Any, str]] = []  # deferred sends: (work, what), waited for at the end
    dist.barrier()  # time the step from a common start
    start = time.perf_counter()
    for k in range(len(actions) + 1):
        if k in plan:
            e = plan[k]
            sends = [(msg, outbox.pop(msg)) for msg in e.sends]
            if config.deferred_sends:
                pending += [(dist.isend(t.contiguous(), link.peer(msg, True)), f"rank {rank} sending {msg}")
                            for msg, t in sends]
                sends = []
            received = link.exchange(sends, e.recvs, shape)
            inbox.update(zip(e.recvs, received))
        if k == len(actions):
            break
        a = actions[k]
        s, i = schedule.stage_of(rank, a), a.micro_batch
        if a.kind == "F":
            inp = xs[i] if s == 0 else local.pop(("F", s, i)) if place[s - 1] == rank else \
                inbox.pop(_message(schedule, "activation", i, s, a))
            fn = (lambda out, i=i: nn.functional.mse_loss(out, ys[i]) * weights[i]) if s == last else None
            saved[(s, i)], out = runners[s].forward(inp, fn)
            if s == last:
                loss += float(out)
            elif place[s + 1] == rank:
                local[("F", s + 1, i)] = out
            else:
                outbox[_message(schedule, "activation", i, s + 1, a)] = out
        elif a.kind == "B":
            grad = None if s == last else local.pop(("B", s, i)) if place[s + 1] == rank else \
                inbox.pop(_message(schedule, "gradient", i, s, a))
            if split:
                grad_x, for_w[(s, i)] = runners[s].backward_input(saved.pop((s, i)), grad)
            else:
                grad_x = runners[s].backward(saved.pop((s, i)), grad)
            if s > 0 and place[s - 1] == rank:
                local[("B", s - 1, i)] = grad_x
            elif s > 0:
                outbox[_message(schedule, "gradient", i, s - 1, a)] = grad_x
        else:
            runners[s].backward_weight(for_w.pop((s, i)))
    for work, what in pending:
        wait_for(work, config.timeout, what)
    seconds = time.perf_counter() - start
    grads = {names[id(p)]: p.grad.clone() for r in runners.values() for p in r.module.parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads, "bytes_sent": link.bytes_sent, "seconds": seconds}


def run_pipeline_ranks(rank: int, world_size: int, configs: list[ProcessConfig]) -> list[dict[str, Any]]:
    """:func:`run_pipeline_rank` for several configs in one launch (start-up is the slow part)."""
    return [run_pipeline_rank(rank, world_size, config) for config in configs]
