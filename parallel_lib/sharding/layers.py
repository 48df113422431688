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

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from parallel_lib.sharding.zero import ZeroEngine

__all__ = ["layer_modules", "StageThreeHooks"]


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
        self._inflight: dict[int, tuple[Any, float]] = {}
        self._started: dict[int, float] = {}
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
        self._inflight[i] = (work, start)

    def gather(self, i: int) -> None:
        """Make group i's parameters full (waiting for its prefetch, if one is in flight)."""
        if i not in self._inflight:
            if self.engine.groups[i].gathered:
                return
            self._start_gather(i, async_op=False)
        work, start = self._inflight.pop(i)
        if work is not None:
            work.wait()
        self._record("comm", start, f"AG {self.engine.groups[i].name}")

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

    def _now(self) -> float:
        recorder = self.engine.recorder
        return recorder.now() if recorder is not None else 0.0

    def _record(self, kind: str, start: float, label: str) -> None:
        recorder = self.engine.recorder
        if recorder is not None:
            lane = f"rank {self.engine.rank} " + ("comm" if kind == "comm" else "compute")
            recorder.add(lane, kind, self.engine.steps, start, recorder.now(), label)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
