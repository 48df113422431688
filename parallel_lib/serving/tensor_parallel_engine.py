"""Tensor-parallel serving: the serving engine on ``tp`` ranks, each with its heads of the weights and of the pool.

Chapter 09 split the static engine by heads; here the continuous engine is split the same way.
Every rank of the tensor-parallel group runs the whole :class:`~parallel_lib.serving.engine.ServingEngine`
over its shard of the one GPT-2 (chapter 07's :func:`~parallel_lib.tensor_parallel.tensor_parallelize`,
the blocks only: ``c_attn`` cut by heads, the MLP by columns then rows; the embedding and the
head stay whole, as Megatron-style serving keeps them when the vocabulary is small)::

    rank r:  scheduler (the same on every rank) ─ plan digest, all-gathered: every rank agrees, or all stop
             embed (whole) ─ per block: my heads' q, k, v ─ my heads of the paged pool ─ c_proj (row) ─ all-reduce
                                     ─ c_fc (my columns) ─ c_proj (row) ─ all-reduce
             ln_f, lm_head (whole) ─ the same logits on every rank ─ the same tokens

**The pool is split by heads.** A rank's attention sees only its ``n_head / tp`` heads, so its
paged KV cache holds only those: each rank's pool is ``1/tp`` of one engine's bytes for the same
number of blocks (vLLM splits its cache the same way). The block tables are not split: every rank
keeps all of them, identical, because every rank schedules the same way.

**One scheduler, replicated.** Nothing sends the plan: every rank is given the same requests in
the same order and runs the same deterministic scheduler (first come first served, preemption of
the newest, chunks by a token budget), so every rank makes the same decisions. The row-parallel
all-reduces give every rank the same hidden states and so the same logits, and sampling uses each
request's own seeded stream: every rank appends the same token. A rank that drifted (a request
added on one rank only) would feed the all-reduces tensors of another shape, or silently other
tokens; so before each forward pass the ranks all-gather a digest of the step's plan (sequences,
their spans, last tokens, block tables, admissions, preemptions) and refuse to run, on every
rank and naming the ranks that differ, when they disagree. It costs one all-gather of ``tp``
integers per step, beside the ``2 · n_layer`` all-reduces of the pass; it waits at most
``timeout`` seconds: when a rank stopped stepping (it thought it was done), the others' TimeoutError
says which rank waited for which step's plan.

:func:`serve_tensor_parallel` launches ``tp`` ranks (gloo on a CPU, NCCL with a GPU per rank)
and returns each rank's :class:`TPServeReport`: its results, pool and weight bytes (storage
census), the digest of every step and the collectives it issued.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence as Seq

import torch
import torch.distributed as dist

from parallel_lib.common.checks import check_int, positive_number
from parallel_lib.inference.batch import Request, Result, check_requests
from parallel_lib.inference.strategies import ServeConfig
from parallel_lib.models.hf import as_gpt2
from parallel_lib.runtime.collectives import count_collectives
from parallel_lib.runtime.device import rank_device
from parallel_lib.runtime.launcher import is_torchrun, run
from parallel_lib.runtime.mesh import Mesh
from parallel_lib.runtime.waiting import wait_for
from parallel_lib.serving.engine import ServingEngine
from parallel_lib.serving.scheduler import Scheduled
from parallel_lib.tensor_parallel import regions as R
from parallel_lib.tensor_parallel.convert import tensor_parallelize
from parallel_lib.tensor_parallel.parallelize import tp_group_of
from parallel_lib.tensor_parallel.split import check_divisible

__all__ = ["plan_digest", "TensorParallelServingEngine", "TPServeReport", "ENGINE_SETTINGS", "check_settings",
           "tp_serving_worker", "serve_tensor_parallel"]

_DEVICE_OF_BACKEND = {"nccl": "cuda", "gloo": "cpu"}  # the collective guard's rule (parallel_lib.runtime.guard)

# what a setting of serve_tensor_parallel may hold: ServingEngine's arguments
ENGINE_SETTINGS = ("num_blocks", "block_size", "max_batch", "prefix_caching", "max_step_tokens")


def plan_digest(plan: Scheduled, tables: Mapping[int, Seq[int]]) -> int:
    """A 56-bit digest of one step's plan: equal on two engines that decided the same step.

    It covers each scheduled sequence's id, the span it feeds, its length and last token, its block
    table, and the step's admissions and preemptions (hashlib's blake2b: the same in every process,
    unlike Python's salted ``hash``).

    Args:
        plan: what the scheduler returned for the step.
        tables: the block table of every scheduled sequence (after the step's allocation).

    Raises:
        KeyError: a scheduled sequence has no table in ``tables``.
    """
    h = hashlib.blake2b(digest_size=7)  # 56 bits: fits an int64 tensor
    for seq, start, stop in zip(plan.sequences, plan.starts, plan.stops):
        tokens = seq.tokens
        h.update(repr((seq.id, start, stop, len(tokens), tokens[-1], list(tables[seq.id]))).encode())
    h.update(repr((list(plan.admitted), list(plan.preempted))).encode())
    return int.from_bytes(h.digest(), "little")


class TensorParallelServingEngine(ServingEngine):
    """The serving engine on this rank's shard of a tensor-parallel group; see the module docstring.

    Call it on every rank of the group with the same dense model and settings, then add the same
    requests in the same order on every rank; every rank gets every result.

    Args:
        model: the dense one GPT-2 or a Hugging Face ``GPT2LMHeadModel`` (copied and split, never changed).
        mesh_or_group: a ``RankMesh`` (its ``"tp"`` axis) or the tensor-parallel process group (None: the
            default group; without ``torch.distributed`` initialised, one rank: the single engine).
        num_blocks, block_size, max_batch, prefix_caching, max_step_tokens: as
            :class:`~parallel_lib.serving.engine.ServingEngine` (the pool's blocks; each holds this
            rank's heads only).
        device: where the shard and its pool live (default: :func:`~parallel_lib.runtime.rank_device`,
            the backend's device: this rank's GPU under NCCL, else the CPU).
        timeout: seconds the plan check waits for the other ranks.

    Raises:
        TypeError: ``model`` is neither GPT-2.
        ValueError: ``model`` is already split; the heads or MLP width not divisible by the group's
            size; a ``device`` the group's backend cannot move (a CPU under NCCL); a bad count or
            ``timeout`` (as ServingEngine).
    """

    def __init__(self, model: Any, mesh_or_group: Any, num_blocks: int, block_size: int = 16, max_batch: int = 8,
                 prefix_caching: bool = False, max_step_tokens: Optional[int] = None,
                 device: Optional[torch.device] = None, timeout: float = 60.0) -> None:
        self.timeout = positive_number("timeout", timeout)
        self.group = tp_group_of(mesh_or_group)
        self.tp, self.rank = R.group_size(self.group), R.group_rank(self.group)
        device = rank_device() if device is None else torch.device(device)
        backend = dist.get_backend(self.group) if self.tp > 1 else None
        if _DEVICE_OF_BACKEND.get(backend, device.type) != device.type:  # NCCL moves CUDA tensors, gloo CPU ones
            raise ValueError(f"device={device} cannot serve over the group's {backend} backend, which moves "
                             f"{_DEVICE_OF_BACKEND[backend]} tensors; pass device=None (the rank's own device)")
        shard = tensor_parallelize(model, self.group, vocab_parallel=False)  # a copy; the head stays whole
        shard = shard.to(device)
        super().__init__(shard, num_blocks, block_size, max_batch, prefix_caching, max_step_tokens)
        self.digests: list[int] = []
        schedule = self.scheduler.schedule

        def agreed(*args: Any, **kwargs: Any) -> Scheduled:  # the scheduler's plan, checked before the pass
            plan = schedule(*args, **kwargs)
            self._agree(plan)
            return plan

        self.scheduler.schedule = agreed

    def add(self, request: Request, index: Optional[int] = None, arrival: Optional[float] = None) -> int:
        """As :meth:`ServingEngine.add <parallel_lib.serving.engine.ServingEngine.add>`; the result names every
        rank of the group as its server (``"tp ranks 0..1 (cpu)"``): each computed its heads."""
        index = super().add(request, index, arrival)
        result = self.results[index]
        if result.served_by and self.tp > 1:  # "" for a request refused before it ran
            result.served_by = f"tp ranks 0..{self.tp - 1} ({result.served_by})"
        return index

    def _agree(self, plan: Scheduled) -> None:
        """All-gather this step's plan digest; raise on every rank when the ranks' plans differ."""
        digest = plan_digest(plan, {s.id: self.blocks.tables[s.id] for s in plan.sequences})
        step = len(self.digests)
        if self.tp > 1:
            mine = torch.tensor([digest], dtype=torch.long, device=self.device)
            every = [torch.empty_like(mine) for _ in range(self.tp)]
            wait_for(dist.all_gather(every, mine, group=self.group, async_op=True), self.timeout,
                     f"tensor-parallel rank {self.rank}: the plan of step {step} from the other ranks")
            digests = torch.cat(every).tolist()
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            if differ:
                raise RuntimeError(
                    f"tensor-parallel rank {self.rank}: step {step}'s plan differs between the ranks (ranks {differ} "
                    f"disagree with rank 0; this rank's plan: requests {[s.id for s in plan.sequences]} feeding "
                    f"{list(zip(plan.starts, plan.stops))}); add the same requests in the same order, with the "
                    "same engine settings, on every rank")
        self.digests.append(digest)


@dataclass
class TPServeReport:
    """What one tensor-parallel rank served and held.

    Attributes:
        rank: its rank in the tensor-parallel group.
        results: every request's result, in request order (every rank computes all of them).
        kv_bytes, weight_bytes: storage of its paged pool and of its parameters (census).
        digests: every step's plan digest (equal on every rank, and to one engine's: same decisions).
        preemptions: sequences preempted; chunked: steps that fed a prompt chunk short of its end.
        collectives: calls of each collective kind while serving (``all_reduce``, ``all_gather``).
        pool: each layer's (keys, values) on the CPU, when asked (``keep_pool``).
        error: what stopped this rank's setting (the plan check's refusal), None when it served.
    """

    rank: int
    results: list[Result]
    kv_bytes: int
    weight_bytes: int
    digests: list[int]
    preemptions: int
    chunked: int
    collectives: dict[str, int] = field(default_factory=dict)
    pool: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    error: Optional[str] = None


def check_settings(settings: Seq[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The settings as dicts, after checking their keys (each is ServingEngine's keyword arguments).

    Raises:
        TypeError: ``settings`` is not a list of dicts, or a dict names an argument not in :data:`ENGINE_SETTINGS`.
        ValueError: ``settings`` is empty, or a setting has no ``num_blocks``.
    """
    if isinstance(settings, Mapping) or not isinstance(settings, (list, tuple)):
        raise TypeError(f"settings must be a list of dicts of ServingEngine arguments, got {type(settings).__name__}; "
                        "wrap one setting in a list")
    if not settings:
        raise ValueError("settings must hold at least one setting, e.g. [dict(num_blocks=64)]")
    out = []
    for i, setting in enumerate(settings):
        if not isinstance(setting, Mapping):
            raise TypeError(f"settings[{i}] must be a dict of ServingEngine arguments, got {type(setting).__name__}")
        unknown = sorted(set(setting) - set(ENGINE_SETTINGS))
        if unknown:
            raise TypeError(f"settings[{i}] names {unknown}, not arguments of the engine; use {list(ENGINE_SETTINGS)}")
        if "num_blocks" not in setting:
            raise ValueError(f"settings[{i}] must give num_blocks (the pool's size), got {dict(setting)}")
        out.append(dict(setting))
    return out


def _weight_bytes(module: torch.nn.Module) -> int:
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}.values())


def tp_serving_worker(rank: int, world_size: int, config: ServeConfig, requests: list[Request],
                      settings: list[dict[str, Any]], timeout: float = 60.0, keep_pool: bool = False,
                      skew: Optional[tuple[int, int]] = None) -> list[TPServeReport]:
    """One rank's work (``launch`` calls it as ``fn(rank, world_size, ...)``): each setting's engine in turn.

    Args:
        config: the model every rank builds (the same seed: the same dense weights).
        requests: added in this order on every rank.
        settings: ServingEngine arguments, one engine per setting.
        timeout: the mesh's and the plan check's limit, seconds.
        keep_pool: return each layer's keys and values (to compare with one engine's heads).
        skew: ``(setting, rank)``: in that setting that rank adds the first request once more, so its
            plans differ from the others' (the plan check's demonstration: every rank's report then
            carries the refusal in ``error``).

    Returns:
        one :class:`TPServeReport` per setting.
    """
    model = as_gpt2(config.build())
    reports = []
    with Mesh(tp=world_size).build(timeout=timeout) as mesh:
        for n, setting in enumerate(settings):
            engine = TensorParallelServingEngine(model, mesh, timeout=timeout, **setting)
            mine = list(requests) + ([requests[0]] if skew == (n, rank) else [])
            error = None
            with count_collectives() as counter:
                try:
                    engine.run(mine)
                except RuntimeError as failure:  # the plan check refused: the same on every rank
                    error = str(failure)
            chunked = sum(any(r.lengths[i] < len(mine[i].prompt) for i in r.prefill) for r in engine.records)
            reports.append(TPServeReport(
                mesh.index("tp"), [engine.results[i] for i in range(len(requests)) if i in engine.results],
                engine.cache.nbytes(), _weight_bytes(engine.model), list(engine.digests), engine.preemptions, chunked,
                {kind: counter.calls_of(kind) for kind in ("all_reduce", "all_gather")},
                {i: (engine.cache.k[i].cpu(), engine.cache.v[i].cpu()) for i in engine.cache.layers} if keep_pool
                else {}, error))
    return reports


def serve_tensor_parallel(requests: Seq[Request], tp: int = 2, config: ServeConfig = ServeConfig(),
                          settings: Seq[Mapping[str, Any]] = ({"num_blocks": 64},), timeout: float = 60.0,
                          keep_pool: bool = False, skew: Optional[tuple[int, int]] = None,
                          **launch_kwargs: Any) -> list[list[TPServeReport]]:
    """Serve ``requests`` on ``tp`` tensor-parallel ranks, once per setting, in ONE launch.

    Args:
        requests: chapter 09 :class:`~parallel_lib.inference.batch.Request` s (every rank adds all of them).
        tp: the tensor-parallel size (ranks); it must divide the model's heads.
        config: the model (:class:`~parallel_lib.inference.strategies.ServeConfig`).
        settings: ServingEngine arguments (``num_blocks``, ``block_size``, ``max_batch``, ``prefix_caching``,
            ``max_step_tokens``), one engine run per setting.
        timeout: seconds for the launch, and for every collective wait inside it.
        keep_pool: bring back each rank's pool (see :class:`TPServeReport`).
        skew: ``(setting, rank)``: that rank adds the first request once more in that setting, to show the
            plan check refusing ranks that disagree: that setting's reports carry the refusal in ``error``.
        **launch_kwargs: ``backend``, ``threads_per_rank``, ``startup_timeout`` for the launcher.

    Returns:
        ``reports[setting][rank]``.

    Raises:
        TypeError, ValueError: bad requests (:func:`~parallel_lib.inference.batch.check_requests`), settings
            (:func:`check_settings`), ``tp`` (not a positive int, or not dividing ``n_head``), ``timeout`` or
            ``skew`` (not a setting and a rank); nothing has started then.
        RuntimeError: a rank's plan check refused a step of a setting not skewed (naming the ranks).
        RankError: a rank failed (naming it).
    """
    model = config.config()
    requests = check_requests(requests, model.n_positions)
    settings = check_settings(settings)
    tp = check_int("tp", tp, minimum=1)
    check_divisible("n_head", model.n_head, tp, hint="choose a tensor-parallel size that divides the number of heads")
    positive_number("timeout", timeout)
    if skew is not None and (not isinstance(skew, tuple) or len(skew) != 2 or skew[0] not in range(len(settings))
                             or skew[1] not in range(tp)):
        raise ValueError(f"skew must be (setting, rank) with setting in 0..{len(settings) - 1} and rank in "
                         f"0..{tp - 1}, or None, got skew={skew!r}")
    per_rank = run(tp_serving_worker, None if is_torchrun() else tp, config, requests, settings, timeout,
                   bool(keep_pool), skew, timeout=timeout, **launch_kwargs)
    reports = [[ranks[n] for ranks in per_rank] for n in range(len(settings))]
    for n, per_setting in enumerate(reports):
        for report in per_setting:
            if report.error is not None and (skew is None or skew[0] != n):
                raise RuntimeError(report.error)
    return reports
