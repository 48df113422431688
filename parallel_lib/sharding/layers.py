"""ZeRO-3's module hooks: gather a layer group just before it computes, free it right after.

Per step, for layer groups 0..L-1 and the "outer" group (embeddings, final norm, tied head):

    forward   root pre-hook: gather outer | layer i pre-hook: gather i (prefetch i+1) | post-hook: free i
              root post-hook: free outer
    backward  a hook on the root's outputs gathers outer again; a hook on layer i's output (it fires
              when the gradient reaches the layer) gathers i (prefetch i-1); once all of group i's
              gradients are final the engine reduce-scatters them and frees the group

So at most the outer group, the layer computing and (with prefetch) the next one are full at
any time. PyTorch's FSDP2 keeps its root group gathered from forward to backward instead
("the root's parameters would typically be immediately all-gathered for backward",
``fully_shard``'s docstring); gathering it twice keeps the traffic at exactly 3 passes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch
from torch import nn

from parallel_lib.common.checks import check_number, positive_int
from parallel_lib.common.timeline import Event, Stamp

if TYPE_CHECKING:
    from parallel_lib.sharding.zero import ZeroEngine

__all__ = ["layer_modules", "StageThreeHooks", "simulate_zero3", "step_events", "mean_durations"]


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The children of the model's ``nn.ModuleList`` holding the most parameters (GPT-2: its blocks).

    Raises:
        ValueError: the model has no ``nn.ModuleList``; pass ``layer_groups`` explicitly.
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers; pass layer_groups=[...] "
                         "(the modules whose parameters are gathered and freed together)")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors that need a gradient in a module's output (a tensor, tuple, dict or ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else []
    return [t for item in items for t in _tensors(item)]


class StageThreeHooks:
    """The forward and backward hooks of ZeRO-3 on a model; ``owners[i]`` is group i's module (None: the root)."""

    def __init__(self, engine: ZeroEngine, model: nn.Module, owners: Sequence[Optional[nn.Module]],
                 prefetch: bool) -> None:
        self.engine, self.prefetch = engine, prefetch
        self._inflight: dict[int, tuple[Any, Stamp, Optional[Stamp]]] = {}  # i -> (work, start, end if known)
        self._started: dict[int, Stamp] = {}
        layer_ids = [i for i, m in enumerate(owners) if m is not None]
        self._next = dict(zip(layer_ids, layer_ids[1:]))       # forward order
        self._previous = dict(zip(layer_ids[1:], layer_ids))   # backward order
        self._handles = []
        for i, module in enumerate(owners):
            target = model if module is None else module
            self._handles.append(target.register_forward_pre_hook(lambda m, a, i=i: self._before_forward(i)))
            self._handles.append(target.register_forward_hook(lambda m, a, o, i=i: self._after_forward(i, o)))

    # --- gather and free ---------------------------------------------------------------------------

    def _start_gather(self, i: int, async_op: bool) -> None:
        group = self.engine.groups[i]
        group.allocate()
        start = self._now()
        work = self.engine.all_gather(group.full, group.shard, async_op=async_op)
        recorder = self.engine.recorder
        # a GPU prefetch ends when the all-gather has run, not when gather() waits for it after computing
        self._inflight[i] = (work, start, recorder.stamp_done(work) if recorder is not None else None)

    def gather(self, i: int) -> None:
        """Make group i's parameters full (waiting for its prefetch, if one is in flight)."""
        if i not in self._inflight:
            if self.engine.groups[i].gathered:
                return
            self._start_gather(i, async_op=False)
        work, start, end = self._inflight.pop(i)
        if work is not None:
            work.wait()
        self._record("comm", start, f"AG {self.engine.groups[i].name}", end)

    @contextmanager
    def all_gathered(self, masters: Sequence[torch.Tensor]) -> Iterator[None]:
        """Every group full inside the block; what the block changed goes back into the shards.

        ``masters[i]`` is group i's optimizer copy (its shard itself, or the fp32 master under bf16),
        which takes the changed values too. A collective between steps: every rank enters it.
        """
        engine = self.engine
        for i in range(len(engine.groups)):
            self.gather(i)
        try:
            yield
        finally:
            for group, master in zip(engine.groups, masters):
                mine = group.full[engine.rank * group.shard_numel:(engine.rank + 1) * group.shard_numel]
                if not torch.equal(mine, group.shard):  # changed inside the block: keep it
                    with torch.no_grad():
                        group.shard.copy_(mine)
                        if master is not group.shard:
                            master.copy_(group.shard)
                group.free()

    def _prefetch(self, i: Optional[int]) -> None:
        if self.prefetch and i is not None and i not in self._inflight and not self.engine.groups[i].gathered:
            self._start_gather(i, async_op=True)

    def free(self, i: int) -> None:
        self.engine.groups[i].free()

    # --- hooks -------------------------------------------------------------------------------------

    def _before_forward(self, i: int) -> None:
        if i == 0:  # once per forward
            self.engine.check_model()
        self.gather(i)
        self._prefetch(self._next.get(i))
        self._started[i] = self._now()

    def _after_forward(self, i: int, output: Any) -> None:
        self._record("forward", self._started.pop(i, self._now()), self.engine.groups[i].name)
        for tensor in _tensors(output):
            tensor.register_hook(lambda grad, i=i: self._before_backward(i))
        self.free(i)

    def _before_backward(self, i: int) -> None:
        if i in self._started:  # another output of the same module already gathered it
            return
        self.gather(i)
        self._prefetch(self._previous.get(i))
        self._started[i] = self._now()

    def after_backward(self, i: int) -> None:
        """Called by the engine once group i's gradients are reduce-scattered: free its parameters."""
        self._record("backward", self._started.pop(i, self._now()), self.engine.groups[i].name)
        self.free(i)

    # --- timeline ----------------------------------------------------------------------------------

    def _now(self) -> Stamp:
        recorder = self.engine.recorder
        return recorder.stamp() if recorder is not None else 0.0

    def _record(self, kind: str, start: Stamp, label: str, end: Optional[Stamp] = None) -> None:
        """An event from ``start`` to ``end`` (default: now, on the compute stream of a GPU)."""
        recorder = self.engine.recorder
        if recorder is not None:
            lane = f"rank {self.engine.rank} " + ("comm" if kind == "comm" else "compute")
            recorder.add_stamped(lane, kind, self.engine.steps, start, recorder.stamp() if end is None else end,
                                 label)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def simulate_zero3(n_groups: int, gather: float, forward: float, backward: float, reduce: float,
                   prefetch: bool, rank: int = 0) -> list[Event]:
    """The timeline ZeRO-3's hooks produce for ``n_groups`` layer groups with fixed durations (seconds).

    One comm lane and one compute lane, as in :class:`StageThreeHooks`'s recording: without
    prefetch group i's all-gather starts when group i-1's compute ends; with prefetch it is
    issued when group i-1's compute starts, so it overlaps that compute. Backward runs the
    groups in reverse, each followed by its gradients' reduce-scatter on the comm lane.
    """
    positive_int("n_groups", n_groups)
    for name, value in dict(gather=gather, forward=forward, backward=backward, reduce=reduce).items():
        check_number(name, value, 0.0)
    comm, compute = f"rank {rank} comm", f"rank {rank} compute"
    events: list[Event] = []
    comm_free = compute_free = previous_start = 0.0
    for phase, order, cost in (("forward", range(n_groups), forward), ("backward", range(n_groups)[::-1], backward)):
        for i in order:
            start = max(comm_free, previous_start if prefetch else compute_free)
            comm_free = start + gather
            events.append(Event(comm, "comm", 0, start, comm_free, f"AG layer {i}"))
            begin = max(comm_free, compute_free)
            compute_free = begin + cost
            previous_start = begin
            events.append(Event(compute, phase, 0, begin, compute_free, f"layer {i}"))
            if phase == "backward":
                rs_start = max(comm_free, compute_free)
                comm_free = rs_start + reduce
                events.append(Event(comm, "comm", 0, rs_start, comm_free, f"RS layer {i}"))
    return events


def step_events(events: Sequence[Event], step: int) -> list[Event]:
    """One step's layer events of a recorded run (the "outer" group's forward spans the whole model: left out)."""
    return [e for e in events if e.micro_batch == step and not (e.kind != "comm" and e.label == "outer")]


def mean_durations(events: Sequence[Event]) -> dict[str, float]:
    """Mean seconds of a layer's all-gather, forward, backward and reduce-scatter: :func:`simulate_zero3`'s inputs."""
    def mean(selected: list[float]) -> float:
        return sum(selected) / len(selected) if selected else 0.0

    layer = [e for e in events if "layer" in e.label]
    return dict(gather=mean([e.duration for e in layer if e.label.startswith("AG")]),
                forward=mean([e.duration for e in layer if e.kind == "forward"]),
                backward=mean([e.duration for e in layer if e.kind == "backward"]),
                reduce=mean([e.duration for e in layer if e.label.startswith("RS")]))
