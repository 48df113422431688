"""Training GPT-2 with tensor parallelism (optionally × data parallelism), and the one-process reference.

:func:`tp_worker` is what each rank runs (from ``launch``, ``torchrun`` or the CLI): it
builds the same dense model on every rank, keeps its shard, trains ``steps`` steps with
AdamW on the same synthetic batches as :func:`dense_run`, counts every collective of each
step and measures the activation bytes saved for backward. Ranks form a (dp, tp)
:class:`~parallel_lib.runtime.mesh.Mesh`: global rank = d·tp + t, so a tensor-parallel group
is a run of neighbouring ranks (one node, in a real cluster) and a data-parallel group takes
one rank from each. The mesh destroys its groups when the run ends, so many runs in one
launch leave no communicators behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.common.models import build_gpt2
from parallel_lib.common.timeline import DeviceClock
from parallel_lib.common.training import TrainRecord
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.mesh import Mesh, RankMesh
from parallel_lib.tensor_parallel.convert import gather_dense, tensor_parallelize
from parallel_lib.tensor_parallel.sequence import sync_sequence_parallel_grads

__all__ = ["TPConfig", "TPResult", "make_batches", "saved_activation_bytes", "tp_mesh", "tp_worker", "dense_run"]


@dataclass(frozen=True)
class TPConfig:
    """One tensor-parallel training run (every field is a flag of ``python -m parallel_lib.tensor_parallel``)."""

    model: str = "tiny"            # a GPT2_SIZES name
    vocab_size: int = 128          # divisible by tp
    batch_size: int = 4            # sequences per data-parallel rank and step
    seq_len: int = 32              # divisible by tp under sequence parallelism
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    tp: int = 0                    # tensor-parallel size; 0: all ranks (dp = world_size / tp)
    sequence_parallel: bool = False
    dropout: float = 0.0           # resid, attn and embd dropout of the model
    padding: bool = True           # right-pad some sequences (attention and loss masks)
    n_layer: int = 0               # 0: the size's own depth
    n_embd: int = 0                # 0: the size's own width (n_head stays; must divide)

    def overrides(self) -> dict[str, Any]:
        """``build_gpt2`` overrides for dropout and the optional depth and width."""
        extra: dict[str, Any] = dict(resid_pdrop=self.dropout, attn_pdrop=self.dropout, embd_pdrop=self.dropout)
        if self.n_layer:
            extra["n_layer"] = self.n_layer
        if self.n_embd:
            extra["n_embd"] = self.n_embd
        return extra


@dataclass
class TPResult:
    """What one rank returns: the run's record, its traffic and memory, and (rank 0) the gathered model."""

    rank: int
    tp: int
    dp: int
    record: TrainRecord
    collectives: dict[str, tuple[int, int]]  # one step's {kind: (calls, message bytes)}, this rank
    wire_bytes: float                        # one step, this rank, ring algorithm
    parameter_bytes: int                     # this rank's shard
    activation_bytes: int                    # saved for backward in one forward, this rank
    state: Optional[dict[str, torch.Tensor]] = None


def make_batches(config: TPConfig, dp: int = 1) -> list[dict[str, torch.Tensor]]:
    """``config.steps`` global batches of ``batch_size · dp`` sequences (the same in every process)."""
    g = torch.Generator().manual_seed(config.seed + 1)
    batches, rows = [], config.batch_size * dp
    for _ in range(config.steps):
        ids = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), generator=g)
        mask = torch.ones(rows, config.seq_len, dtype=torch.long)
        if config.padding:  # every other sequence ends early: right padding
            lengths = torch.randint(config.seq_len // 2, config.seq_len + 1, (rows,), generator=g)
            mask = (torch.arange(config.seq_len)[None] < lengths[:, None]).long()
            mask[0] = 1  # at least one full row
        batches.append(dict(input_ids=ids[:, :-1], labels=ids[:, 1:], attention_mask=mask,
                            label_token_weights=mask.float()))
    return batches


def saved_activation_bytes(fn: Any, *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` and the bytes of the distinct tensors autograd saved for backward meanwhile.

    Counted by storage (a tensor saved twice, or a parameter, counts once; parameters are
    left out), as the course counts memory: not process RSS.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = getattr(t, "_local_tensor", t).untyped_storage()  # a DTensor's bytes are its local shard's
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict, denominator: float,
          dp_group: Any, dp: int) -> tuple[torch.Tensor, int]:
    """One AdamW step; returns the loss and the activation bytes its forward saved for backward."""
    optimizer.zero_grad(set_to_none=True)
    logits, activations = saved_activation_bytes(model, batch["input_ids"], batch["attention_mask"])
    loss = _loss(model, logits, batch, denominator)
    loss.backward()
    sync_sequence_parallel_grads(model)
    if dp > 1:  # the loss was divided by the global batch's weight: summed gradients are the mean
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
    optimizer.step()
    return loss.detach(), activations


def _loss(model: torch.nn.Module, logits: torch.Tensor, batch: dict, denominator: float) -> torch.Tensor:
    """The model head's weighted loss, rescaled from this rank's weight to the global batch's ``denominator``."""
    weights = batch["label_token_weights"]
    return model.loss(logits, batch["labels"], weights) * weights.sum() / denominator


def tp_mesh(world_size: int, tp: int) -> Mesh:
    """The (dp, tp) mesh of a run: ``tp`` ranks per group (0: all of them), the rest data parallel.

    Raises:
        ValueError: ``tp`` does not divide ``world_size``.
    """
    return Mesh.of_world(world_size, tp=tp or world_size)


def tp_worker(rank: int, world_size: int, config: TPConfig, return_state: bool = True) -> TPResult:
    """One rank of a tensor-parallel (× data-parallel) run: the module docstring says what it does."""
    positive_int("steps", config.steps)
    check_number("dropout", config.dropout, 0.0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tp_mesh(world_size, config.tp).build() as pm:  # its groups are destroyed when the run ends
        return _tp_run(pm, config, return_state)


def _tp_run(pm: RankMesh, config: TPConfig, return_state: bool) -> TPResult:
    tp_group, dp_group, tp, dp = pm.group("tp"), pm.group("dp"), pm.size("tp"), pm.size("dp")
    rank, d = pm.rank, pm.index("dp")
    dense = build_gpt2(config.model, config.vocab_size, config.seed, **config.overrides())
    device = rank_device()  # this rank's GPU under NCCL, else the CPU
    model = tensor_parallelize(dense, tp_group, config.sequence_parallel, dropout_seed=config.seed).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    record, clock = TrainRecord(), DeviceClock(p.device for p in model.parameters())
    counted: dict[str, tuple[int, int]] = {}
    wire, activations = 0.0, 0
    for k, batch in enumerate(make_batches(config, dp)):
        denominator = float(batch["label_token_weights"].sum())
        mine = {key: v.chunk(dp)[d].to(device) for key, v in batch.items()}
        start = clock()
        with count_collectives() as counter:
            loss, saved = _step(model, optimizer, mine, denominator, dp_group, dp)
        if k == 0:  # the first step's traffic and memory: every step is the same
            counted, wire, activations = counter.by_kind(), counter.wire_bytes(), saved
        if dp > 1:
            dist.all_reduce(loss, group=dp_group)
        record.append(float(loss), int(mine["label_token_weights"].sum()), clock() - start)
    state = None
    gathered = gather_dense(model) if return_state else None  # a collective of the tp group
    if gathered is not None and rank == 0:
        state = {key: v.clone() for key, v in gathered.state_dict().items()}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return TPResult(rank, tp, dp, record, counted, wire, param_bytes, activations, state)


def dense_run(config: TPConfig, dp: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the whole global batch: the losses and final parameters the ranks must match.

    The model is the one GPT-2 (:mod:`parallel_lib.models`) split over one rank (tp = 1): with
    dropout it draws the same masks as the ranks; without, it equals Hugging Face's GPT-2
    (tests/test_gpt2_model.py).
    """
    model = tensor_parallelize(build_gpt2(config.model, config.vocab_size, config.seed, **config.overrides()),
                               None, dropout_seed=config.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    losses = []
    for batch in make_batches(config, dp):
        losses.append(float(_step(model, optimizer, batch, float(batch["label_token_weights"].sum()), None, 1)[0]))
    return losses, {key: v.clone() for key, v in gather_dense(model).state_dict().items()}
