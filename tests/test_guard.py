"""The collective guard: a call that would crash or hang under NCCL fails at once on a CPU run, naming the call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_lib.runtime import RankError, launch
from parallel_lib.runtime.guard import (
    GUARD_ENV,
    CollectiveGuardError,
    allow_bare_p2p,
    check_devices,
    collective_guard,
    guard_active,
)


def test_a_cpu_tensor_in_an_nccl_collective_names_the_call_the_device_and_the_backend():
    with collective_guard(backend="nccl"):
        with pytest.raises(CollectiveGuardError, match=r"dist\.all_reduce got a tensor on cpu.*backend is nccl"):
            dist.all_reduce(torch.ones(2))
        with pytest.raises(CollectiveGuardError, match=r"dist\.broadcast got a tensor on cpu"):
            dist.broadcast(torch.ones(2), 0)
        with pytest.raises(CollectiveGuardError, match=r"dist\.all_gather got a tensor on cpu"):
            dist.all_gather([torch.ones(2), torch.ones(2)], torch.ones(2))


def test_the_device_rule_per_backend():
    check_devices("all_reduce", [torch.ones(1)], "gloo")
    check_devices("all_reduce", [torch.ones(1)], "cpu:gloo,cuda:nccl")  # a group with a backend per device
    check_devices("all_reduce", [torch.ones(1)], "mpi")  # not checked
    with pytest.raises(CollectiveGuardError, match=r"dist\.reduce_scatter_single got a tensor on cpu.*cuda"):
        check_devices("reduce_scatter_single", [torch.ones(1)], "nccl")
    with pytest.raises(CollectiveGuardError, match=r"dist\.all_reduce got a tensor on meta.*gloo"):
        check_devices("all_reduce", [torch.ones(1), torch.ones(1, device="meta")], "gloo")


@pytest.mark.parametrize("call", ["send", "recv", "isend", "irecv"])
def test_a_bare_point_to_point_message_fails_at_once(call):
    with pytest.raises(CollectiveGuardError, match=rf"dist\.{call} outside dist\.batch_isend_irecv"):
        getattr(dist, call)(torch.ones(1), 1)
    with allow_bare_p2p():  # passes the guard; torch then says there is no process group
        with pytest.raises(Exception) as error:
            getattr(dist, call)(torch.ones(1), 1)
        assert not isinstance(error.value, CollectiveGuardError)


def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match=r"backend=.*'mpi'"):
        with collective_guard(backend="mpi"):
            pass


def guarded_rank(rank: int, world_size: int, how: str) -> tuple[bool, str, float]:
    """Whether the guard is on in this rank; then one exchange: "batched", "bare", or batched as if on NCCL."""
    import os

    peer = 1 - rank
    received = torch.zeros(3)
    if how == "nccl":
        ops = [dist.P2POp(dist.isend, torch.ones(3), peer), dist.P2POp(dist.irecv, received, peer)]
        with collective_guard(backend="nccl"):
            try:
                dist.batch_isend_irecv(ops)
            except CollectiveGuardError as error:
                return ops[0].op == dist.isend, str(error), 0.0  # the ops come back as they were
    if how == "bare":
        if rank == 0:
            dist.send(torch.ones(3), peer)
        else:
            dist.recv(received, peer)
    else:
        ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer), dist.P2POp(dist.irecv, received, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return guard_active(), os.environ.get(GUARD_ENV, ""), received[0].item()


def test_every_launched_rank_runs_under_the_guard():
    for rank, (active, env, received) in enumerate(launch(guarded_rank, 2, "batched", backend="gloo", timeout=60)):
        assert active and env == "1" and received == 1 - rank
    with pytest.raises(RankError, match=r"dist\.(send|recv) outside dist\.batch_isend_irecv"):
        launch(guarded_rank, 2, "bare", backend="gloo", timeout=60)
    for same_ops, message, _ in launch(guarded_rank, 2, "nccl", backend="gloo", timeout=60):
        assert same_ops and "dist.batch_isend_irecv got a tensor on cpu, but its group's backend is nccl" in message


def calibrate_on_a_stand_in_default_device(rank: int, world_size: int) -> tuple[str, str]:
    """Calibrate with the default device set to "meta": a tensor that is not on ``rank_device()`` lands there.

    On a GPU node the launch picks NCCL and every collective needs the rank's GPU; a CPU run can only
    show that each tensor comes from ``rank_device()``, by making every other tensor land on a device
    that the guard refuses under gloo.
    """
    from parallel_lib.planner.calibrate import collective_worker

    torch.set_default_device("meta")
    try:
        speed = collective_worker(rank, world_size, sizes=(4096, 8192), repeats=1)
    except CollectiveGuardError as error:
        return "guard", str(error)
    finally:
        torch.set_default_device(None)
    return "ok", ",".join(sorted(speed.links))


def test_the_calibration_hands_collectives_tensors_on_the_rank_device_only():
    for outcome, detail in launch(calibrate_on_a_stand_in_default_device, 2, backend="gloo", timeout=120):
        assert (outcome, detail) == ("ok", "all_gather,all_reduce,reduce_scatter,send"), detail


def test_torchs_own_point_to_point_protocols_are_torchs_business():
    # torch.distributed.pipelining sends bare warm-up messages; the guard checks the code that calls torch
    from torch.distributed.pipelining import stage

    code = compile("def warm_up(): dist.send(torch.ones(1), 1)", stage.__file__, "exec")
    namespace = {"dist": dist, "torch": torch}
    exec(code, namespace)
    with pytest.raises(Exception) as error:  # past the guard; torch says there is no process group
        namespace["warm_up"]()
    assert not isinstance(error.value, CollectiveGuardError)


def test_the_whole_suite_runs_under_the_guard():
    import os

    assert guard_active() and os.environ[GUARD_ENV] == "1"  # tests/conftest.py: this process and every rank
