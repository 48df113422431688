"""Exactness checks that run inside ranks: ring and Ulysses attention, GPT-2 with ring attention, PyTorch's CP.

:func:`attention_check` is a ``launch`` worker (``fn(rank, world_size, cases)``). Every rank
draws the same whole q, k, v and output gradient from one seed, runs full attention on them
(the reference), takes its shard (:mod:`.layout`), runs the context-parallel attention over
the mesh's ``cp`` group and returns, per case, the largest differences of its output and
gradients from the same shard of the reference, the work it did, the bytes it sent (forward
and backward, from the collective counter) and the bytes it kept for backward (the census).
:func:`gpt2_check` does the same for the whole model (:mod:`.parallelize`), and
:func:`torch_context_parallel_check` runs PyTorch's own context parallelism beside ours where it can.
Several checks share one launch (:func:`several`): starting ranks costs more than they do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import time

import torch
import torch.distributed as dist

from parallel_lib.common.saved_tensors import SavedTensors
from parallel_lib.common.checks import check_choice
from parallel_lib.context_parallel.cost import METHODS
from parallel_lib.context_parallel.layout import LAYOUTS, gather_sequence, shard_sequence
from parallel_lib.context_parallel.parallelize import cp_shard, parallelize_cp
from parallel_lib.context_parallel.ring import ring_attention
from parallel_lib.context_parallel.tiled import TileWork, full_attention
from parallel_lib.context_parallel.ulysses import ulysses_attention
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.models.gpt2 import build_model
from parallel_lib.runtime.mesh import Mesh
from parallel_lib.runtime.waiting import wait_for

__all__ = ["Case", "CaseResult", "attention_check", "stalled_peer_check", "gpt2_check", "cp_dp_training_check",
           "torch_context_parallel_check", "several"]


@dataclass(frozen=True)
class Case:
    """One context-parallel attention to check: method, mask, layout and shape (the whole sequence)."""

    method: str = "ring"          # "ring" or "ulysses"
    causal: bool = True
    layout: str = "contiguous"    # "contiguous" or "zigzag"
    batch: int = 1
    heads: int = 2
    seq_len: int = 32
    head_dim: int = 8
    block: int = 8                # tile size inside each step
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        check_choice("layout", self.layout, LAYOUTS)


@dataclass
class CaseResult:
    """What one rank found for one :class:`Case`."""

    case: Case
    errors: dict[str, float] = field(default_factory=dict)   # output, dq, dk, dv: largest |difference|
    work: TileWork = field(default_factory=TileWork)          # tiles this rank computed forward
    forward_bytes: float = 0.0                               # sent, as the collective counter saw it
    backward_bytes: float = 0.0
    saved_bytes: int = 0                                     # kept for backward beyond q, k, v (census)
    record: list = field(default_factory=list)               # the ring's RingEvent of every step (ring only)
    calls: dict[str, Any] = field(default_factory=dict)      # {kind: (calls, bytes)} forward and backward


def _one(case: Case, group: Any, index: int, cp: int, timeout: float) -> CaseResult:
    gen = torch.Generator().manual_seed(case.seed)
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)
    q, k, v, upstream = (torch.randn(shape, generator=gen).to(rank_device()) for _ in range(4))
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reference = full_attention(*whole, causal=case.causal)
    reference.backward(upstream)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, cp, index, case.layout, dim=2)

    local = [mine(t).requires_grad_(True) for t in (q, k, v)]
    result = CaseResult(case)
    options: dict[str, Any] = dict(causal=case.causal, layout=case.layout, block=case.block, timeout=timeout,
                                   work=result.work)
    with count_collectives() as forward, SavedTensors(exclude=local) as saved:
        if case.method == "ring":
            out = ring_attention(*local, group, record=result.record, **options)
        else:
            out = ulysses_attention(*local, group, **options)
    with count_collectives() as backward:
        out.backward(mine(upstream))
    result.errors = {"output": float((out.detach() - mine(reference.detach())).abs().max())}
    for name, got, want in zip(("dq", "dk", "dv"), local, whole):
        result.errors[name] = float((got.grad - mine(want.grad)).abs().max())
    result.forward_bytes, result.backward_bytes = forward.wire_bytes(), backward.wire_bytes()
    result.saved_bytes = saved.nbytes
    result.calls = {"forward": forward.by_kind(), "backward": backward.by_kind()}
    return result


def attention_check(rank: int, world_size: int, cases: Sequence[Case], timeout: float = 60.0) -> list[dict]:
    """Run every case on a ``Mesh(cp=world_size)``; return this rank's findings (dicts of :class:`CaseResult`).

    Args:
        rank, world_size: from ``launch``.
        cases: the :class:`Case` list, the same on every rank.
        timeout: seconds any exchange may wait.
    """
    with Mesh(cp=world_size).build(timeout=timeout) as pm:
        group = pm.group("cp")
        return [asdict(_one(case, group, pm.index("cp"), world_size, timeout)) for case in cases]


def stalled_peer_check(rank: int, world_size: int, methods: Sequence[str] = METHODS,
                       timeout: float = 1.0) -> list[str]:
    """Rank 0 runs each attention, the others never join it: rank 0's error messages (others: empty).

    Each exchange must give up after ``timeout`` seconds with a ``TimeoutError`` naming the rank
    that waited, where a bare wait would hang for the group's timeout (gloo: 30 minutes). Each
    method runs on a mesh of its own, so a message left behind by one cannot meet the next.
    """
    found = []
    for method in methods:
        with Mesh(cp=world_size).build(timeout=30.0) as pm:
            if rank != 0:
                time.sleep(3 * timeout)
                continue
            q = torch.randn(1, world_size, 4, 4)
            attention = ring_attention if method == "ring" else ulysses_attention
            try:
                attention(q, q, q, pm.group("cp"), causal=True, timeout=timeout)
                found.append("no error")
            except TimeoutError as error:
                found.append(str(error))
    return found


def gpt2_check(rank: int, world_size: int, layouts: Sequence[str] = LAYOUTS, seq_len: int = 32,
               batch: int = 2, vocab_size: int = 64, timeout: float = 60.0) -> dict[str, dict[str, float]]:
    """The tiny GPT-2 made context-parallel (:func:`.parallelize.parallelize_cp`) against the dense one.

    Every rank runs the dense model on the whole batch, then the context-parallel copy on its
    tokens; the loss is each rank's tokens' cross-entropy summed and divided by all tokens, so
    the gradients, summed over ``cp``, are one process's.

    Returns:
        ``{layout: {"logits": …, "loss": …, "grads": …}}``: largest differences (grads: over every parameter).
    """
    gen, device = torch.Generator().manual_seed(1), rank_device()
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
    labels = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
    dense = build_model("tiny", vocab_size, seed=0).to(device)
    logits = dense(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    found: dict[str, dict[str, float]] = {}
    with Mesh(cp=world_size).build(timeout=timeout) as pm:
        group = pm.group("cp")
        for layout in layouts:
            model = parallelize_cp(build_model("tiny", vocab_size, seed=0).to(device), pm, layout=layout, block=8,
                                   timeout=timeout)
            my_ids, positions = cp_shard(model, ids)
            my_labels = shard_sequence(labels, world_size, pm.index("cp"), layout, dim=1)
            mine = model(my_ids, positions=positions)
            part = torch.nn.functional.cross_entropy(mine.flatten(0, 1), my_labels.flatten(), reduction="sum")
            (part / labels.numel()).backward()
            total = part.detach().clone()
            dist.all_reduce(total, group=group)
            grads = dict(dense.named_parameters())
            worst = 0.0
            for name, p in model.named_parameters():
                dist.all_reduce(p.grad, group=group)
                worst = max(worst, float((p.grad - grads[name].grad).abs().max()))
            expected = shard_sequence(logits.detach(), world_size, pm.index("cp"), layout, dim=1)
            found[layout] = {"logits": float((mine.detach() - expected).abs().max()),
                             "loss": abs(float(total) / labels.numel() - float(loss.detach())), "grads": worst}
    return found


def _sum_loss(model: Any, ids: torch.Tensor, labels: torch.Tensor, positions: Any = None) -> torch.Tensor:
    logits = model(ids) if positions is None else model(ids, positions=positions)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def cp_dp_training_check(rank: int, world_size: int, steps: int = 3, seq_len: int = 32, vocab_size: int = 64,
                         layout: str = "zigzag", timeout: float = 60.0) -> dict[str, float]:
    """GPT-2 trained ``steps`` AdamW steps on a ``Mesh(dp=2, cp=world_size/2)`` against one process.

    Each data-parallel replica takes one sequence of the batch, each of its cp ranks that
    sequence's tokens (``layout``); the loss is summed over a rank's tokens and divided by the
    batch's, so one all-reduce (a sum) over the flattened ``("dp", "cp")`` group gives every
    rank one process's gradient, and AdamW then takes the same step everywhere.

    Returns:
        ``{"loss": largest difference of the step losses, "parameters": of the parameters after the steps}``.
    """
    dp, cp = 2, world_size // 2
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, vocab_size, (dp, seq_len), generator=gen),
                torch.randint(0, vocab_size, (dp, seq_len), generator=gen)) for _ in range(steps)]
    dense = build_model("tiny", vocab_size, seed=0)
    optimizer = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    losses = []
    for ids, labels in batches:
        optimizer.zero_grad()
        loss = _sum_loss(dense, ids, labels) / labels.numel()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    with Mesh(dp=dp, cp=cp).build(timeout=timeout, flatten=[("dp", "cp")]) as pm:
        model = parallelize_cp(build_model("tiny", vocab_size, seed=0), pm, layout=layout, block=8, timeout=timeout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        replica, both = pm.index("dp"), pm.group(("dp", "cp"))
        worst_loss = 0.0
        for (ids, labels), expected in zip(batches, losses):
            optimizer.zero_grad()
            my_ids, positions = cp_shard(model, ids[replica:replica + 1])
            my_labels = shard_sequence(labels[replica:replica + 1], cp, pm.index("cp"), layout, dim=1)
            part = _sum_loss(model, my_ids, my_labels, positions)
            (part / labels.numel()).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=both)
            optimizer.step()
            total = part.detach().clone()
            dist.all_reduce(total, group=both)
            worst_loss = max(worst_loss, abs(float(total) / labels.numel() - expected))
        dense_params = dict(dense.named_parameters())
        worst = max(float((p.detach() - dense_params[n].detach()).abs().max()) for n, p in model.named_parameters())
    return {"loss": worst_loss, "parameters": worst}


def torch_context_parallel_check(rank: int, world_size: int, seq_len: int = 16,
                                 timeout: float = 60.0) -> dict[str, Any]:
    """PyTorch's own ``context_parallel`` on causal SDPA beside ours, on the same inputs, where it runs.

    Every rank draws the same whole q, k, v (one seed). Ours: this rank's zig-zag shard through
    :func:`~parallel_lib.context_parallel.ring.ring_attention`, every rank's output all-gathered and
    put back in sequence order. PyTorch's: ``context_parallel`` shards the buffers (its own
    load-balanced order), SDPA runs inside it, ``context_parallel_unshard`` gathers the output.

    Returns:
        ``{"ours": largest difference of our whole output from SDPA in one process, "ran": True,
        "output": PyTorch's from SDPA, "beside_ours": PyTorch's from ours}``, or, where PyTorch
        refuses, ``{"ours": ..., "ran": False, "error": its message}``: its context parallelism
        intercepts only the CUDA SDPA kernels (flash, memory-efficient, cuDNN); on a CPU, SDPA calls
        ``_scaled_dot_product_flash_attention_for_cpu``, which has no sharding rule (torch 2.13).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq_len, 8, generator=gen).to(device) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    group = mesh.get_group("cp")
    index = dist.get_rank(group)
    mine = ring_attention(*(shard_sequence(t, world_size, index, "zigzag", dim=2) for t in (q, k, v)), group,
                          causal=True, layout="zigzag", block=8, timeout=timeout).contiguous()
    shards = [torch.empty_like(mine) for _ in range(world_size)]
    wait_for(dist.all_gather(shards, mine, group=group, async_op=True), timeout,
             f"rank {rank}: the other ranks' ring attention outputs")
    ours = gather_sequence(shards, "zigzag", dim=2)
    found: dict[str, Any] = {"ours": float((ours - expected).abs().max())}
    buffers = [t.clone() for t in (q, k, v)]
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            out = torch.nn.functional.scaled_dot_product_attention(*buffers, is_causal=True)
        (whole,) = context_parallel_unshard(mesh, [out], [2])
    except (NotImplementedError, RuntimeError) as error:   # a refusal, reported beside ours (GPU check, test)
        return {**found, "ran": False, "error": f"{type(error).__name__}: {error}"}
    return {**found, "ran": True, "output": float((whole - expected).abs().max()),
            "beside_ours": float((whole - ours).abs().max())}


def several(rank: int, world_size: int, jobs: Sequence[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` for each ``(fn, args)`` in one launch: what each returned."""
    return [fn(rank, world_size, *args) for fn, args in jobs]
