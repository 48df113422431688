"""Launching ranks (from a notebook or under torchrun), devices, and the environment report.

The bottom layer: every chapter starts its ranks with :func:`launch` (or :func:`run`,
which picks torchrun when the process was started by it) and asks :func:`devices` /
:func:`resolve_device` where to compute.

What launches ranks, file by file:

- ``launcher``: the public ``launch``, ``run_torchrun``, ``run``;
- ``group``: ``RankInfo``, the backend choice, the rendezvous store bound to loopback, joining the group;
- ``payload``: pickling the job here and unpickling it in the rank, naming what cannot travel;
- ``spawned``: the rank's entry point and its watch on the parent;
- ``supervise``: waiting for the ranks (start-up and run timeouts) and stopping them;
- ``failures``: ``RankError``/``LaunchTimeoutError`` and what each symptom usually means;
- ``mesh``: the ranks on named axes (dp, pp, ep, cp, tp) and every process group, built once;
- ``guard``: the collective guard, which checks NCCL's two rules (tensors on the backend's
  device, point-to-point only inside ``batch_isend_irecv``) on a CPU run.
"""

from parallel_lib.runtime.collectives import CollectiveCall, CollectiveCounter, count_collectives, ring_wire_bytes
from parallel_lib.runtime.device import DeviceKey, check_device_keys, cpu_count, devices, rank_device, resolve_device
from parallel_lib.runtime.mesh import AXES, MEGATRON_ORDER, Mesh, RankMesh
from parallel_lib.runtime.environment import all_reduce_demo, environment_info, environment_report, machine_label
from parallel_lib.runtime.guard import CollectiveGuardError, allow_bare_p2p, collective_guard, guard_from_environment
from parallel_lib.runtime.launcher import (
    BACKENDS,
    LaunchTimeoutError,
    RankError,
    RankInfo,
    is_torchrun,
    launch,
    resolve_backend,
    run,
    run_torchrun,
)

__all__ = [
    "AXES",
    "MEGATRON_ORDER",
    "Mesh",
    "RankMesh",
    "CollectiveCall",
    "CollectiveCounter",
    "count_collectives",
    "ring_wire_bytes",
    "CollectiveGuardError",
    "collective_guard",
    "allow_bare_p2p",
    "guard_from_environment",
    "DeviceKey",
    "cpu_count",
    "rank_device",
    "devices",
    "resolve_device",
    "check_device_keys",
    "environment_info",
    "environment_report",
    "machine_label",
    "all_reduce_demo",
    "RankError",
    "LaunchTimeoutError",
    "RankInfo",
    "BACKENDS",
    "launch",
    "run_torchrun",
    "run",
    "is_torchrun",
    "resolve_backend",
]
