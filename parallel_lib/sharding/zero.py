"""ZeRO stages 0-3 written from the ring's two halves: reduce-scatter and all-gather.

Data parallelism keeps every model state on every rank. ZeRO (Rajbhandari et al., 2020,
arXiv:1910.02054) keeps each rank's *shard* only, one state more per stage:

    stage | gradients after backward          | optimizer step        | parameters
    ------+-----------------------------------+-----------------------+-----------------------------
      0   | all-reduce (plain data parallel)  | every element         | full on every rank
      1   | reduce-scatter into the full grad | this rank's shard     | all-gather after the step
      2   | reduce-scatter per bucket, from   | this rank's shard     | all-gather after the step
          | backward hooks; full grads freed  |                       |
      3   | as 2, per layer group             | this rank's shard     | shards only; each layer group
          |                                   |                       | all-gathered before its forward
          |                                   |                       | and backward, freed right after

[1] The optimizer is ``torch.optim.AdamW`` over one flat shard per group (its update is
element-wise, so AdamW on a slice equals AdamW on the whole). [2] Under
``precision="bf16"`` the model holds bf16 parameters and gradients and the shard keeps
an fp32 master copy: the 2 + 2 + 12 bytes per parameter of the ZeRO paper.
[3] Collectives come from ``torch.distributed`` or, with ``collectives="ring"``, from
the course's :func:`~parallel_lib.data_parallel.ring.ring_reduce_scatter` and
:func:`~parallel_lib.data_parallel.ring.ring_all_gather`.

Use: ``engine = ZeroEngine(model, stage=2)``, then per step ``model(...).loss.backward()`` (once, or
once per micro-batch to accumulate), optionally ``engine.clip_grad_norm_(1.0)``, and ``engine.step()``,
which also zeroes the gradients. Between steps a stage-3 model holds no full parameter: read or
load it inside ``with engine.gathered():``, save it with ``engine.full_state_dict()``
(:mod:`~parallel_lib.sharding.guards` turns any other access, and torch's own
``clip_grad_norm_``, into an error that says so).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel_lib.common.checks import check_choice, check_int, positive_number
from parallel_lib.common.timeline import TimelineRecorder
from parallel_lib.data_parallel.ring import require_process_group, ring_all_gather, ring_reduce_scatter
from parallel_lib.runtime.compat import all_gather_single, reduce_scatter_single
from parallel_lib.sharding.flat import FlatParamGroup
from parallel_lib.sharding.grouping import flat_groups
from parallel_lib.sharding.guards import (ENGINE_MARK, guard_parameter, install_clip_guard, refuse_freed_state_dicts,
                                         unguard_parameter)
from parallel_lib.sharding.layers import StageThreeHooks

__all__ = ["STAGES", "COLLECTIVES", "PRECISIONS", "ZeroEngine"]

STAGES = (0, 1, 2, 3)
COLLECTIVES = ("torch", "ring")
PRECISIONS = ("fp32", "bf16")


class ZeroEngine:
    """Shard a model's training state over the ranks of ``group`` (ZeRO stage 0-3).

    Args:
        model: the replica, the same on every rank (same seed); its trainable parameters are
            flattened into buffers whose views they become. Frozen ones stay as they are.
        stage: 0 (data parallel), 1, 2 or 3.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters.
        precision: "fp32", or "bf16" (bf16 parameters and gradients, fp32 master and moments).
        collectives: "torch" (``reduce_scatter_tensor``/``all_gather_into_tensor``) or "ring".
        bucket_cap_mb: largest bucket of stages 0-2, in 2**20 bytes (25 as DDP).
        prefetch: stage 3 with torch collectives: start the next layer group's all-gather
            before computing the current one.
        layer_groups: stage 3's layer groups (default: the children of the model's largest
            ``nn.ModuleList``, GPT-2's blocks); the remaining parameters form one more group.
        recorder: record "comm" events (all-reduces, reduce-scatters, all-gathers) on lane
            "rank R comm" and, stage 3, each layer group's forward and backward on "rank R compute";
            on a GPU build it with ``TimelineRecorder(device=...)``: CUDA events, no synchronisation
            (an asynchronous collective ends when it has run, see
            :meth:`~parallel_lib.common.timeline.TimelineRecorder.stamp_done`).
        group: the data-parallel ranks to shard over (a mesh's ``pm.group("dp")``); None: every rank.
        separate: parameters that each get a flat group of their own, so that this rank's shard of
            their gradient covers the same elements on every model that shares them (a pipeline's
            tied embedding: its copies on the first and last stage are summed shard by shard,
            :meth:`reduced_gradient`).

    Raises:
        RuntimeError: no initialised process group.
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a stage that is not an int in 0-3, an unknown precision or collectives, or more
            ranks than trainable elements to shard.
    """

    def __init__(self, model: nn.Module, stage: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, precision: str = "fp32", collectives: str = "torch",
                 bucket_cap_mb: float = 25.0, prefetch: bool = False,
                 layer_groups: Optional[Sequence[nn.Module]] = None,
                 recorder: Optional[TimelineRecorder] = None, group: Any = None,
                 separate: Sequence[nn.Parameter] = ()) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module (the replica to shard), got model={model!r} "
                            f"({type(model).__name__}); build it first, e.g. build_gpt2('tiny')")
        self.stage = check_choice("stage", check_int("stage", stage), STAGES)
        require_process_group("ZeroEngine")
        self.precision = check_choice("precision", precision, PRECISIONS)
        self.collectives = check_choice("collectives", collectives, COLLECTIVES)
        positive_number("bucket_cap_mb", bucket_cap_mb)
        self.model, self.recorder, self.group = model, recorder, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        for name, p in model.named_parameters():
            p._zero_name = name  # type: ignore[attr-defined]  # for error messages
        trainable = [p for p in model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in trainable)
        if total < self.world_size:
            raise ValueError(f"world_size={self.world_size} is larger than the {total} trainable elements to "
                             "shard: every rank needs at least one; use fewer ranks or a larger model")
        self.steps = 0
        self._reduced = False
        self._model_params = {id(p) for p in model.parameters()}
        alone = [p for p in separate if p.requires_grad]
        if {id(p) for p in alone} - {id(p) for p in trainable}:
            raise ValueError("separate must hold parameters of the model (trainable ones)")
        self._separate = {id(p) for p in alone}
        planned = flat_groups(model, stage, alone, int(bucket_cap_mb * 2**20), layer_groups)
        self.groups = [FlatParamGroup(ps, self.world_size, self.rank, name)
                       for ps, name in zip(planned.params, planned.names)]
        if stage == 3:  # the shard becomes the parameters' only persistent storage
            for g in self.groups:
                g.own_shard()
        self._build_optimizer(lr, betas, eps, weight_decay)
        self.grad_shards: list[Optional[torch.Tensor]] = [None] * len(self.groups)
        self._pending: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []  # (group, work, packed, shard)
        self._ready: list[set[int]] = [set() for _ in self.groups]
        self._launched = [False] * len(self.groups)  # reduce-scattered at least once since the last step
        self._group_of = {id(p): i for i, g in enumerate(self.groups) for p in g.params}
        self._hooks = []
        if stage >= 2:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                           for g in self.groups for p in g.params]
        install_clip_guard()
        for g in self.groups:
            for p in g.params:
                setattr(p, ENGINE_MARK, True)  # torch's clip_grad_norm_ refuses them
        self.layers: Optional[StageThreeHooks] = None
        if stage == 3:
            for g in self.groups:
                g.free()
                for p in g.params:  # reading a freed parameter raises instead of reading freed memory
                    guard_parameter(p)
            self.layers = StageThreeHooks(self, model, planned.owners, prefetch and collectives == "torch")
            self._hooks += refuse_freed_state_dicts(model, lambda: any(not g.gathered for g in self.groups))

    # --- set-up ------------------------------------------------------------------------------------

    def _build_optimizer(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """[1] AdamW over one flat tensor per group: the full buffer (stage 0) or this rank's shard."""
        owned = [g.full if self.stage == 0 else g.shard for g in self.groups]
        if self.precision == "bf16":  # [2] fp32 master from the fp32 values, then the model goes bf16
            self.master = [t.detach().clone().float() for t in owned]
            for g in self.groups:
                g.cast(torch.bfloat16)
        else:
            self.master = owned
        if self.stage <= 1:  # the full gradient stays: let backward accumulate into one flat buffer
            self.grad_full = [torch.zeros_like(g.full) for g in self.groups]
            self._point_grads()
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @staticmethod
    def _adopt_grads(group: FlatParamGroup, buffer: torch.Tensor) -> None:
        """Copy into ``buffer`` the gradients that are not views of it (after a ``model.zero_grad()``)."""
        for p, offset, shape in zip(group.params, group.offsets, group.shapes):
            part = buffer[offset:offset + shape.numel()]
            if p.grad is None:
                part.zero_()
            elif p.grad.data_ptr() != part.data_ptr():
                part.copy_(p.grad.reshape(-1))

    def _point_grads(self) -> None:
        for g, buffer in zip(self.groups, self.grad_full):
            for p, offset, shape in zip(g.params, g.offsets, g.shapes):
                p.grad = buffer[offset:offset + shape.numel()].view(shape)

    # --- collectives -------------------------------------------------------------------------------

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        """[3] SUM of ``input`` over ranks, this rank's chunk into ``output``."""
        if self.collectives == "ring":
            ring_reduce_scatter(output, input, group=self.group)
            return None
        return reduce_scatter_single(output, input, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        """[3] Every rank's ``input`` into ``output``, in rank order."""
        if self.collectives == "ring":
            ring_all_gather(output, input, group=self.group)
            return None
        return all_gather_single(output, input, group=self.group, async_op=async_op)

    def _timed(self, label: str, fn: Callable[[], Any]) -> Any:
        """Run the collective ``fn`` as a "comm" event: to its end on a GPU, to its return on a CPU."""
        if self.recorder is None:
            return fn()
        start = self.recorder.stamp()
        work = fn()
        end = self.recorder.stamp_done(work)  # None: blocking, or a CPU
        self.recorder.add_stamped(f"rank {self.rank} comm", "comm", self.steps, start,
                                  self.recorder.stamp() if end is None else end, label)
        return work

    # --- gradients ---------------------------------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Stage 2-3 hook: once a group's gradients are all final, reduce-scatter them and free them."""
        i = self._group_of[id(param)]
        self._ready[i].add(id(param))
        if len(self._ready[i]) == len(self.groups[i].params):
            self._launch_reduce(i)

    def _launch_reduce(self, i: int) -> None:
        group = self.groups[i]
        packed = group.pack_grads()
        for p in group.params:  # stage 2-3: the full gradient lives only in ``packed`` until reduced
            p.grad = None
        if self.layers is not None:  # stage 3: the group's backward is over, its parameters can go
            self.layers.after_backward(i)
        shard = torch.empty(group.shard_numel, dtype=packed.dtype, device=packed.device)
        work = self._timed(f"RS {group.name}", lambda: self.reduce_scatter(shard, packed, async_op=True))
        self._pending.append((i, work, packed, shard))
        self._ready[i], self._launched[i] = set(), True  # a second backward (accumulation) starts afresh

    def reduce_gradients(self) -> None:
        """Finish every gradient collective: afterwards each rank holds its shard's mean gradient.

        :meth:`step` calls it; call it first to look at the state between backward and step.
        """
        if self._reduced:
            return
        self._reduced = True
        if self.stage <= 1:
            for group, buffer in zip(self.groups, self.grad_full):
                self._adopt_grads(group, buffer)
                if self.stage == 0:
                    self._timed(f"AR {group.name}", lambda: dist.all_reduce(buffer, group=self.group))
                else:  # the ring's first half: this rank's chunk summed, kept in place
                    shard = torch.empty(group.shard_numel, dtype=buffer.dtype, device=buffer.device)
                    self._timed(f"RS {group.name}", lambda: self.reduce_scatter(shard, buffer))
                    buffer[self.rank * group.shard_numel:(self.rank + 1) * group.shard_numel].copy_(shard)
                buffer /= self.world_size
            return
        for i in range(len(self.groups)):  # parameters that got no gradient still join, as zeros
            if self._ready[i] or not self._launched[i]:
                self._launch_reduce(i)
        for i, work, _, shard in self._pending:  # several per group when backward ran several times
            if work is not None:
                work.wait()
            shard.div_(self.world_size)
            self.grad_shards[i] = shard if self.grad_shards[i] is None else self.grad_shards[i].add_(shard)
        self._pending.clear()

    def reduced_gradient(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's part of ``param``'s mean gradient, after :meth:`reduce_gradients` (a view: edit in place).

        The whole gradient at stage 0, this rank's shard of it at stages 1-3. ``param`` must have
        been given in ``separate``, so that the shard is the same slice of it on every rank's
        copy (sum a pipeline's tied copies with one all-reduce of this tensor).

        Raises:
            ValueError: ``param`` was not given in ``separate``.
            RuntimeError: called before :meth:`reduce_gradients`.
        """
        if id(param) not in self._separate:
            raise ValueError("reduced_gradient needs a parameter given in ZeroEngine(..., separate=[...])")
        i = self._group_of[id(param)]
        if not self._reduced:
            raise RuntimeError("call reduce_gradients() first: before it the gradient is not reduced")
        group = self.groups[i]
        if self.stage == 0:
            return self.grad_full[i]
        if self.stage == 1:
            return self.grad_full[i][self.rank * group.shard_numel:(self.rank + 1) * group.shard_numel]
        return self.grad_shards[i]  # type: ignore[return-value]  # reduce_gradients filled every group

    def _owned_gradients(self) -> list[torch.Tensor]:
        """This rank's disjoint part of the mean gradient, real elements only (no padding), per group."""
        out = []
        for i, group in enumerate(self.groups):
            if self.stage == 0:  # every rank holds the whole mean gradient: each counts it all, no all-reduce
                out.append(self.grad_full[i][:group.numel])
                continue
            start = self.rank * group.shard_numel
            real = max(0, min(group.shard_numel, group.numel - start))  # the last ranks' shards end in padding
            shard = self.grad_full[i][start:start + group.shard_numel] if self.stage == 1 else self.grad_shards[i]
            out.append(shard[:real])  # type: ignore[index]  # reduce_gradients filled every group
        return out

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the mean gradient so that its global L2 norm is at most ``max_norm``; returns the norm before.

        The same result as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` in one
        process on the whole batch (the same ``max_norm / (norm + 1e-6)`` factor): each rank sums the
        squares of its shard of the averaged gradient and one all-reduce over the engine's group adds
        them (stage 0: every rank already holds the whole gradient). Call it on every rank after the
        backward passes and before :meth:`step`. The norm covers this engine's parameters over its group;
        a model also split by tensor or pipeline parallelism needs those groups' parts added too.

        Raises:
            ValueError: ``max_norm`` not a finite number > 0.
        """
        positive_number("max_norm", max_norm)
        self.reduce_gradients()
        owned = self._owned_gradients()
        squares = torch.zeros((), dtype=torch.float32, device=self.groups[0].full.device)
        for grad in owned:
            squares += grad.float().pow(2).sum()
        if self.stage > 0:
            self._timed("AR grad norm", lambda: dist.all_reduce(squares, group=self.group))
        total = squares.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in owned:
            grad.mul_(scale.to(grad.dtype))
        return total

    # --- the step ----------------------------------------------------------------------------------

    def step(self) -> None:
        """Reduce the gradients, update this rank's shard, all-gather the parameters, zero the gradients.

        Raises:
            RuntimeError: the model changed after sharding, or a collective failed.
        """
        self.check_model()
        self.reduce_gradients()
        for i, (group, master) in enumerate(zip(self.groups, self.master)):
            if self.stage == 0:
                grad = self.grad_full[i]
            elif self.stage == 1:
                grad = self.grad_full[i][self.rank * group.shard_numel:(self.rank + 1) * group.shard_numel]
            else:
                grad = self.grad_shards[i]
            master.grad = grad.to(master.dtype)
        self.optimizer.step()
        for group, master in zip(self.groups, self.master):
            with torch.no_grad():
                owned = group.full if self.stage == 0 else group.shard
                if master is not owned:  # bf16: the model gets the rounded master
                    owned.copy_(master)
                if self.stage in (1, 2):  # [3] the ring's second half: everyone's updated shard
                    self._timed(f"AG {group.name}", lambda: self.all_gather(group.full, group.shard.clone()))
        self.zero_grad()
        self.steps += 1

    def zero_grad(self) -> None:
        """Drop this step's gradients (stages 0-1: zero the flat gradient buffer the parameters view)."""
        for master in self.master:
            master.grad = None
        self.grad_shards = [None] * len(self.groups)
        self._ready, self._launched = [set() for _ in self.groups], [False] * len(self.groups)
        self._reduced = False
        if self.stage <= 1:
            for buffer in self.grad_full:
                buffer.zero_()
            self._point_grads()
        else:
            for group in self.groups:
                for p in group.params:
                    p.grad = None

    def check_model(self) -> None:
        """Raise RuntimeError if the model's parameters changed since the engine sharded them."""
        params = {id(p) for p in self.model.parameters()}
        if params != self._model_params:
            raise RuntimeError("the model's parameters changed after sharding (added or removed); "
                               "build a new ZeroEngine for the changed model")
        for group in self.groups:
            group.check_unchanged(params)

    # --- the full parameters of stage 3 ------------------------------------------------------------

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: every parameter full inside the block; what it changed is kept in the shards after it.

        A collective: enter it on every rank of the group, between steps (not inside a forward or
        backward). ``with engine.gathered(): model.load_state_dict(state)`` loads a plain state dict
        (stage 3 with bf16: the fp32 master takes the loaded values). Stages 0-2 hold full parameters
        already: the block just runs.
        """
        if self.layers is None:
            yield
            return
        with self.layers.all_gathered(self.master):
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every parameter full (copies), on every rank; a collective at stage 3."""
        with self.gathered():
            return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def remove(self) -> None:
        """Unregister every hook; stage 3 gathers the full parameters back into the model first."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.layers is not None:
            for i in range(len(self.groups)):
                self.layers.gather(i)
            self.layers.remove()
            self.layers = None
        for group in self.groups:
            for p in group.params:
                unguard_parameter(p)
                if hasattr(p, ENGINE_MARK):
                    delattr(p, ENGINE_MARK)
