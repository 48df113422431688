"""Training GPT-2 with ZeRO, with DDP, or with PyTorch's own sharding, on the same batches.

Every rank builds the same model (same seed) and takes its rows of each global batch of
token ids; each rank's loss is the mean over its rows, all ranks hold equally many, so
the mean of the ranks' gradients is the gradient of the whole batch and every strategy
must give the parameters one process gets on the global batch
(:func:`single_process_reference`). Strategies (``ShardConfig.strategy``):

- "zero": :class:`~parallel_lib.sharding.zero.ZeroEngine` at ``stage`` 0-3;
- "ddp": ``DistributedDataParallel`` + AdamW;
- "zero_redundancy": DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1);
- "fsdp2": ``torch.distributed.fsdp.fully_shard`` on every block and the model (ZeRO-3).

Run from a notebook with ``launch(run_sharded, world_size, ShardConfig(...))`` or from a shell
(:mod:`parallel_lib.sharding.cli`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.checks import check_choice, check_number, positive_int
from parallel_lib.common.models import build_gpt2
from parallel_lib.common.timeline import DeviceClock, Event, TimelineRecorder
from parallel_lib.common.training import TrainRecord
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.sharding.checkpoint import load_full, shard_state
from parallel_lib.sharding.memory import engine_census, optimizer_tensors, storage_census
from parallel_lib.sharding.zero import ZeroEngine

__all__ = ["STRATEGIES", "ShardConfig", "ShardResult", "global_batches", "build_model", "run_sharded",
           "single_process_reference"]

STRATEGIES = ("zero", "ddp", "zero_redundancy", "fsdp2")


@dataclass(frozen=True)
class ShardConfig:
    """One run; every rank gets the same config."""

    strategy: str = "zero"          # one of STRATEGIES
    stage: int = 2                  # ZeRO stage (strategy "zero")
    model: str = "tiny"             # a GPT2_SIZES name
    vocab_size: int = 512
    batch_size: int = 8             # the GLOBAL batch (rows); each rank takes batch_size // world_size
    seq_len: int = 32
    steps: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 0.0      # clip the gradient to this global L2 norm before each step (0: no clipping)
    precision: str = "fp32"         # "fp32" or "bf16" (ZeRO: bf16 params/grads, fp32 master)
    collectives: str = "torch"      # "torch" or "ring" (ZeRO)
    prefetch: bool = False          # ZeRO-3: all-gather the next layer group early
    bucket_cap_mb: float = 25.0
    freeze: tuple[str, ...] = ()    # parameter names to freeze (requires_grad=False)
    seed: int = 0
    data_seed: int = 1234
    measure_step: int = 1           # the step whose census and collectives are returned
    timeline: bool = False          # record ZeRO's collectives and per-group compute (events)
    return_state: bool = True       # send the final full parameters back
    return_shards: bool = False     # ZeRO: send this rank's checkpoint shard back (checkpoint.shard_state)


@dataclass
class ShardResult:
    """What one rank measured."""

    rank: int
    world_size: int
    config: ShardConfig
    record: TrainRecord                  # global mean loss per step, global tokens, this rank's step time
    census: dict[str, int]               # bytes of params, grads, optimizer states after backward of measure_step
    wire_bytes: float                    # bytes this rank sent in measure_step (ring algorithm)
    calls: dict[str, tuple[int, int]]    # collectives of measure_step: kind -> (calls, message bytes)
    num_params: int                      # Ψ, trainable parameters
    state: Optional[dict[str, torch.Tensor]] = None
    events: list[Event] = field(default_factory=list)
    shards: Optional[dict[str, Any]] = None  # checkpoint.shard_state after the last step
    padding: int = 0                         # ZeRO: elements added to round every group up to a multiple of N


def global_batches(config: ShardConfig) -> torch.Tensor:
    """``(steps, batch_size, seq_len)`` token ids, the same in every process."""
    g = torch.Generator().manual_seed(config.data_seed)
    return torch.randint(0, config.vocab_size, (config.steps, config.batch_size, config.seq_len), generator=g)


def build_model(config: ShardConfig) -> nn.Module:
    """The run's GPT-2 (tied embedding and head), with ``config.freeze`` frozen."""
    model = build_gpt2(config.model, vocab_size=config.vocab_size, seed=config.seed,
                       n_positions=max(config.seq_len, 16))
    model.loss_type = "ForCausalLM"  # the loss of ``labels=``; unset, transformers warns on every first call
    names = dict(model.named_parameters())
    for name in config.freeze:
        if name not in names:
            raise ValueError(f"freeze names an unknown parameter {name!r}; e.g. {list(names)[:3]}")
        names[name].requires_grad_(False)
    return model


def _check(config: ShardConfig, world_size: int) -> None:
    check_choice("strategy", config.strategy, STRATEGIES)
    positive_int("steps", config.steps)
    check_number("max_grad_norm", config.max_grad_norm, 0.0, hint="0 turns clipping off")
    if config.batch_size % world_size:
        raise ValueError(f"batch_size={config.batch_size} must be a multiple of world_size={world_size} "
                         "(every rank takes as many rows)")


def single_process_reference(config: ShardConfig, steps: Optional[int] = None,
                             resume: Optional[tuple[dict[str, torch.Tensor], dict[str, Any], int]] = None,
                             ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    """One process, AdamW on the global batches: (losses, final parameters, AdamW state dict).

    ``steps`` stops early; ``resume`` = ``(model_state, adamw_state, first_step)`` continues a checkpoint.
    """
    model = build_model(config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay)
    first = 0
    if resume is not None:
        model.load_state_dict(resume[0], strict=False)  # frozen parameters are not in a ZeRO checkpoint
        optimizer.load_state_dict(resume[1])
        first = resume[2]
    losses = []
    for batch in global_batches(config)[first:steps]:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer.state_dict()


def _prepare(config: ShardConfig, model: nn.Module, recorder: Optional[TimelineRecorder]) -> tuple[nn.Module, Any]:
    """(the module to call, the object whose ``step()`` ends a step) for the strategy."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    adamw = dict(lr=config.lr, weight_decay=config.weight_decay)
    if config.strategy == "zero":
        engine = ZeroEngine(model, config.stage, precision=config.precision, collectives=config.collectives,
                            bucket_cap_mb=config.bucket_cap_mb, prefetch=config.prefetch, recorder=recorder, **adamw)
        return model, engine
    if config.strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adamw)
    device = rank_device()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                              bucket_cap_mb=config.bucket_cap_mb)
    ddp.register_comm_hook(None, _counted_all_reduce)  # DDP's own C++ all-reduce is invisible to the counter
    if config.strategy == "ddp":
        return ddp, torch.optim.AdamW(trainable, **adamw)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ddp, ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, **adamw)


def _counted_all_reduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    """DDP's default all-reduce hook, but through ``dist.all_reduce`` so that count_collectives sees it."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _clip(model: nn.Module, stepper: Any, max_norm: float) -> None:
    """Clip by the norm of the averaged gradient: the engine's own call, or torch's (DDP and FSDP2 average first)."""
    if isinstance(stepper, ZeroEngine):
        stepper.clip_grad_norm_(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _census(config: ShardConfig, model: nn.Module, stepper: Any) -> dict[str, int]:
    if isinstance(stepper, ZeroEngine):
        stepper.reduce_gradients()
        return engine_census(stepper)
    optimizer = getattr(stepper, "optim", stepper)  # ZeroRedundancyOptimizer keeps its shard's AdamW in .optim
    return storage_census(list(model.parameters()), [p.grad for p in model.parameters()], optimizer_tensors(optimizer))


def full_state(model: nn.Module, stepper: Any) -> dict[str, torch.Tensor]:
    """The full parameters by name, on every rank (gathering ZeRO-3's and FSDP2's shards)."""
    if isinstance(stepper, ZeroEngine) and stepper.layers is not None:
        stepper.remove()  # gathers every group back into the model
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # tied weights under both names
        tensor = p.detach()
        out[name] = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).float().cpu().clone()
    return out


def run_sharded(rank: int, world_size: int, config: ShardConfig,
                resume: Optional[tuple[dict[str, torch.Tensor], dict[str, Any], int]] = None) -> ShardResult:
    """Train ``config.steps`` steps on this rank's rows; measure step ``measure_step``.

    Args:
        resume: ZeRO only: ``(model_state, adamw_state, first_step)`` of a plain checkpoint
            (``checkpoint.consolidate`` or a plain AdamW run) to continue from.

    Raises:
        ValueError: an unknown strategy, a batch that does not split evenly over the ranks,
            or ``resume`` with a strategy other than "zero".
    """
    _check(config, world_size)
    torch.set_num_threads(1)
    device = rank_device()  # the CPU under gloo, this rank's GPU under NCCL
    clock = DeviceClock([device])  # a step ends when this rank's device has run it
    model = build_model(config).to(device)
    recorder = TimelineRecorder(device=device) if config.timeline else None  # a GPU: CUDA events, read at the end
    module, stepper = _prepare(config, model, recorder)
    first = 0
    if resume is not None:
        if not isinstance(stepper, ZeroEngine):
            raise ValueError(f"resume needs strategy='zero', got strategy={config.strategy!r}")
        load_full(stepper, resume[0], resume[1])
        first = resume[2]
    rows = config.batch_size // world_size
    record, census, wire, calls = TrainRecord(), {}, 0.0, {}
    for step, batch in enumerate(global_batches(config)):
        if step < first:
            continue
        local = batch[rank * rows:(rank + 1) * rows].to(device)
        measured = step == config.measure_step
        start = clock()
        with count_collectives() as counter:
            loss = module(input_ids=local, labels=local).loss
            loss.backward()
            if measured:
                census = _census(config, model, stepper)
            if config.max_grad_norm:
                _clip(model, stepper, config.max_grad_norm)
            stepper.step()
            if not isinstance(stepper, ZeroEngine):
                stepper.zero_grad(set_to_none=True)
        seconds = clock() - start
        if measured:
            wire, calls = counter.wire_bytes(), counter.by_kind()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)  # reporting only, outside the counted step
        record.append(mean_loss.item() / world_size, int(batch.numel()), seconds)
    num_params = sum(p.numel() for p in build_model(config).parameters() if p.requires_grad)
    shards = shard_state(stepper) if config.return_shards and isinstance(stepper, ZeroEngine) else None
    state = full_state(model, stepper) if config.return_state else None
    padding = sum(g.padded - g.numel for g in stepper.groups) if isinstance(stepper, ZeroEngine) else 0
    return ShardResult(rank, world_size, config, record, census, wire, calls, num_params, state,
                       recorder.events if recorder else [], shards, padding)
