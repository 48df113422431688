"""What a :class:`~parallel_lib.pipeline_parallel.Pipe` step needs around its runtime: the stages' layout
(model stages per device for every schedule), the error a failed action raises, checkpointing's
choices, and the sum of a tied weight's two gradients.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional, Sequence, Union

from torch import Tensor, nn

from parallel_lib.model_parallel.device_map import DeviceMap
from parallel_lib.pipeline_parallel.microbatch import split_layers
from parallel_lib.pipeline_parallel.schedule import Action, Schedule, make_schedule, stages_per_rank
from parallel_lib.runtime.device import DeviceKey

__all__ = ["StageError", "LossFn", "Checkpoint", "CHECKPOINTS", "layout", "sum_tied_gradients"]

LossFn = Callable[..., Tensor]
Checkpoint = Literal["never", "except_last", "always"]
CHECKPOINTS = ("never", "except_last", "always")  # torchgpipe's choices: which micro-batches recompute


class StageError(RuntimeError):
    """A stage raised while running an action; the original exception is the ``__cause__``.

    Attributes:
        stage: index of the failing stage.
        action: the failing action, e.g. ``B(2)``.
    """

    def __init__(self, stage: int, action: Action, error: BaseException) -> None:
        super().__init__(f"stage {stage} failed in {action} (micro-batch {action.micro_batch}): "
                         f"{type(error).__name__}: {error} (the step's gradients are partial: zero them "
                         f"before the next step)")
        self.stage = stage
        self.action = action


def layout(n_layers: int, devices: Union[Sequence[DeviceKey], DeviceMap], schedule: Union[str, Schedule]
           ) -> tuple[list[DeviceKey], list[list[int]], tuple[int, ...]]:
    """``(device key per rank, layer indices per model stage, rank per model stage)`` for a schedule.

    ``schedule`` is a name, or a hand-written :class:`Schedule`, whose ``placement`` then says where
    its model stages live; it must have one rank per device.

    Raises:
        ValueError: a device map for a schedule with several stages per device (it places them itself),
            fewer layers than such a schedule's stages, or a hand-written schedule for another number of devices.
    """
    if isinstance(schedule, Schedule):
        if len(devices) != schedule.num_stages:
            raise ValueError(f"schedule {schedule.name!r} is written for {schedule.num_stages} ranks, got "
                             f"{len(devices)} devices; give one device per rank")
        v, label = schedule.virtual, schedule.name
    else:
        v, label = stages_per_rank(schedule), schedule
    if v > 1 and isinstance(devices, (list, tuple)) and n_layers < v * len(devices):
        fits = n_layers // v
        raise ValueError(f"schedule={label!r} cuts the layers into {v} stages per device, so {len(devices)} "
                         f"devices need at least {v * len(devices)} layers, and the module has {n_layers}; "
                         + (f"use at most {fits} devices, or " if fits else "use ")
                         + "a schedule with one stage per device (e.g. '1f1b')")
    keys, stage_layers = split_layers(n_layers, devices, "layers")
    if v == 1:
        return keys, stage_layers, tuple(range(len(keys)))
    if isinstance(devices, dict):
        raise ValueError(f"schedule={label!r} places {v} stages on each device "
                         f"itself: give a list of devices, not a device map")
    placement = (schedule.placement if isinstance(schedule, Schedule)  # 2p: an m every named one accepts (DualPipeV)
                 else make_schedule(schedule, len(keys), 2 * len(keys)).placement)
    _, stage_layers = split_layers(n_layers, [keys[r] for r in placement], "layers")
    return keys, stage_layers, placement


def sum_tied_gradients(pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], before: list[Optional[Tensor]]) -> None:
    """Give both copies of a tied weight the sum of this step's gradients of each."""
    for (a, b), a_before in zip(pairs, before):
        if a.grad is None or b.grad is None:
            continue
        # the pair held equal gradients before this step, so what each gained is its own
        # contribution this step; each copy adds the other's
        gained_a = a.grad - a_before if a_before is not None else a.grad.clone()
        gained_b = b.grad - a_before.to(b.device) if a_before is not None else b.grad.clone()
        a.grad += gained_b.to(a.device)
        b.grad += gained_a.to(b.device)
