"""The process engine: one rank per pipeline rank, any schedule, over the pipeline group's communicator.

Each rank builds the same model from the same seed, keeps only the model stages the schedule's
placement gives it, and runs its action list with the one pipeline runtime
(:func:`~parallel_lib.pipeline_parallel.runtime.run_actions`) over a
:class:`~parallel_lib.pipeline_parallel.transports.ProcessLink`: between two actions it runs the
exchanges its plan puts there, each ONE ``batch_isend_irecv`` on the pipeline group (gloo on the
CPU, NCCL with a GPU per rank), with no tags and receive buffers of the sender's dtype on the
rank's device. A neighbour stage on the same rank (the turn of a V) is a hand-over in memory.

Which plan: the paired exchanges of chapter 05 (the sends of action k-1 with the receives of
action k, in the sender's order; the receives before any W actions that come just before action k,
so a W runs while the neighbour computes) where :func:`~parallel_lib.pipeline_parallel.link.find_deadlock`
accepts them (GPipe, 1F1B, ZB-H1, ZB-H2); exchanges in rounds where it does not (interleaved and
the V schedules, which :func:`~parallel_lib.pipeline_parallel.hangs.check_blocking` refuses
paired). Every message waits for its partner in both (gloo's sends block like NCCL's large ones).

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

from parallel_lib.common.checks import check_choice, check_int, positive_int, positive_number
from parallel_lib.pipeline_parallel.link import StageLink, wait_for
from parallel_lib.pipeline_parallel.microbatch import loss_weights, split_layers
from parallel_lib.pipeline_parallel.runtime import RankStages, run_actions
from parallel_lib.pipeline_parallel.schedule import make_schedule
from parallel_lib.pipeline_parallel.stage import StageRunner, move_stage
from parallel_lib.pipeline_parallel.transports import ProcessLink
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import Mesh

__all__ = ["ProcessConfig", "mlp_and_batch", "run_pipeline_rank", "run_pipeline_ranks"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class ProcessConfig:
    """One training step: an MLP of ``blocks`` x (Linear(width, width), Tanh), MSE loss, ``rows`` rows.

    Raises:
        ValueError: a size that is not an int >= 1, fewer ``rows`` than ``micro_batches`` (an empty
            micro-batch's mean loss is NaN), a timeout that is not > 0, or an unknown dtype.
    """

    schedule: str = "1f1b"
    micro_batches: int = 4
    width: int = 16
    blocks: int = 8
    rows: int = 16
    seed: int = 0
    timeout: float = 30.0
    dtype: str = "float32"  # the model's and the batch's dtype (so the activations' sent between ranks)

    def __post_init__(self) -> None:
        for name in ("micro_batches", "width", "blocks", "rows"):
            positive_int(name, getattr(self, name))
        if self.rows < self.micro_batches:
            raise ValueError(f"rows={self.rows} cannot fill micro_batches={self.micro_batches}: each micro-batch "
                             "needs at least one row (an empty one's mean loss is NaN); use rows >= micro_batches")
        check_int("seed", self.seed)
        positive_number("timeout", self.timeout, hint="seconds each message may take")
        check_choice("dtype", self.dtype, sorted(DTYPES))

    @property
    def torch_dtype(self) -> torch.dtype:
        check_choice("dtype", self.dtype, sorted(DTYPES))
        return DTYPES[self.dtype]


def mlp_and_batch(config: ProcessConfig) -> tuple[nn.Sequential, Tensor, Tensor]:
    """The model and the batch every rank (and the one-process reference) builds alike."""
    torch.manual_seed(config.seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh())
                            for _ in range(config.blocks)]).to(config.torch_dtype)
    g = torch.Generator().manual_seed(config.seed + 1)
    x, y = (torch.randn(config.rows, config.width, generator=g) for _ in range(2))
    return model, x.to(config.torch_dtype), y.to(config.torch_dtype)


def run_pipeline_rank(rank: int, world_size: int, config: ProcessConfig) -> dict[str, Any]:
    """Run rank ``rank``'s actions of one training step; the worker function for ``launch``.

    Raises:
        ValueError: a schedule no exchange plan runs without a deadlock, or an unknown dtype.
        TimeoutError: a message did not come within ``config.timeout`` (naming it and the peer).
    """
    torch.set_num_threads(1)
    schedule = make_schedule(config.schedule, world_size, config.micro_batches)
    device = rank_device()
    model, x, y = mlp_and_batch(config)
    names = {id(p): name for name, p in model.named_parameters()}
    place = schedule.placement
    _, layers = split_layers(len(model), ["cpu"] * len(place), "layers")
    runners = {s: StageRunner(move_stage(nn.Sequential(*[model[k] for k in layers[s]]), device), device, first=s == 0)
               for s in range(len(place)) if place[s] == rank}  # only this rank's stages reach its device
    m = schedule.num_micro_batches
    xs, ys = x.tensor_split(m), y.tensor_split(m)
    weights = loss_weights([t.size(0) for t in xs], "mean")
    spec = lambda message: ((xs[message.micro_batch].size(0), config.width), config.torch_dtype)  # noqa: E731
    stages = RankStages(schedule, rank, runners, [t.to(device) for t in xs],
                        loss=lambda i: lambda out: nn.functional.mse_loss(out, ys[i].to(device)) * weights[i])
    with Mesh(pp=world_size).build(timeout=config.timeout) as pm:
        link = StageLink(None, None, f"rank {rank}", config.timeout, device, group=pm.group("pp"))
        transport = ProcessLink(schedule, rank, link, pm.peers("pp"), spec)
        # NCCL: the first p2p call in a group must involve every rank of it; a barrier sets it up first
        wait_for(dist.barrier(group=pm.group("pp"), async_op=True), config.timeout, f"rank {rank}: start-up barrier")
        start = time.perf_counter()
        run_actions(schedule, rank, stages, transport)
        seconds = time.perf_counter() - start
    grads = {names[id(p)]: p.grad.cpu().clone() for r in runners.values() for p in r.module.parameters()
             if p.grad is not None}
    return {"loss": stages.loss_sum(), "grads": grads, "bytes_sent": link.bytes_sent, "seconds": seconds}


def run_pipeline_ranks(rank: int, world_size: int, configs: list[ProcessConfig]) -> list[dict[str, Any]]:
    """:func:`run_pipeline_rank` for several configs in one launch (start-up is the slow part)."""
    return [run_pipeline_rank(rank, world_size, config) for config in configs]
