"""What a :class:`~parallel_lib.pipeline_parallel.Pipe` step needs around its runtime: the stages' layout
(model stages per device for every schedule), the error a failed action raises, checkpointing's
choices, and the sum of a tied weight's two gradients.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional, Sequence, Union

from torch import Tensor, nn

from parallel_lib.model_parallel.device_map import DeviceMap
from parallel_lib.pipeline_parallel.microbatch import split_layers
from parallel_lib.pipeline_parallel.schedule import Action, make_schedule, stages_per_rank
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


def layout(n_layers: int, devices: Union[Sequence[DeviceKey], DeviceMap], schedule: str
           ) -> tuple[list[DeviceKey], list[list[int]], tuple[int, ...]]:
    """``(device key per rank, layer indices per model stage, rank per model stage)`` for a schedule.

    Raises:
        ValueError: a device map for a schedule with several stages per device (it places them itself), or
            fewer layers than such a schedule's stages.
    """
    v = stages_per_rank(schedule)
    if v > 1 and isinstance(devices, (list, tuple)) and n_layers < v * len(devices):
        fits = n_layers // v
        raise ValueError(f"schedule={schedule!r} cuts the layers into {v} stages per device, so {len(devices)} "
                         f"devices need at least {v * len(devices)} layers, and the module has {n_layers}; "
                         + (f"use at most {fits} devices, or " if fits else "use ")
                         + "a schedule with one stage per device (e.g. '1f1b')")
    keys, stage_layers = split_layers(n_layers, devices, "layers")
    if v == 1:
        return keys, stage_layers, tuple(range(len(keys)))
    if isinstance(devices, dict):
        raise ValueError(f"schedule={schedule!r} places {stages_per_rank(schedule)} stages on each device "
                         f"itself: give a list of devices, not a device map")
    placement = make_schedule(schedule, len(keys), 2 * len(keys)).placement  # an m every schedule accepts (DualPipeV: m >= 2p)
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
