"""The ``torchrun`` command line of a multi-node data-parallel job.

Going from ``launch`` in a notebook to ``torchrun`` on several hosts changes who starts the
processes and how they find each other (a c10d rendezvous at one host's address), not what
each rank computes. :func:`torchrun_command` writes the line every node runs (the real
multi-node one, or a loopback rehearsal); :mod:`parallel_lib.training.rehearsal` trains the
rehearsal on this machine and checks that ``launch`` and ``torchrun`` end with the same
parameters::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 --rdzv-id rehearsal -m parallel_lib.training.rehearsal --out node0.pt
"""

from __future__ import annotations

import shlex
from typing import Mapping, Optional, Sequence

from parallel_lib.common.checks import positive_int

__all__ = ["torchrun_command", "format_command"]


def torchrun_command(nnodes: int, nproc_per_node: int, endpoint: str, run_id: str = "parallel-llm-course",
                     module: str = "parallel_lib.data_parallel", args: Sequence[str] = (), python: Optional[str] = None,
                     rdzv_conf: Optional[Mapping[str, object]] = None) -> list[str]:
    """The ``torchrun`` command line that every node of a c10d-rendezvous job runs.

    All nodes run this same command: ``endpoint`` is one host's address that every
    node can reach (a node on that host serves the rendezvous store), and the c10d
    rendezvous numbers the nodes as they join, so there is no ``--node-rank`` to
    vary (torchrun ignores it for c10d, with a warning).

    Args:
        nnodes: number of nodes (hosts) in the job.
        nproc_per_node: ranks on each node (its GPUs, or CPU processes).
        endpoint: ``HOST:PORT`` of the rendezvous, e.g. ``"10.0.0.1:29500"``.
        run_id: the job's name; nodes with the same id join the same job.
        module: the module each rank runs with ``-m``.
        args: the module's own arguments.
        python: run torchrun as ``python -m torch.distributed.run`` with this
            interpreter (None: the ``torchrun`` script on the PATH).
        rdzv_conf: extra rendezvous settings, e.g. ``{"join_timeout": 60}``.

    Returns:
        The command as a list of arguments (see :func:`format_command` to print it).

    Raises:
        ValueError: a count below 1, or an endpoint that is not ``HOST:PORT``.
    """
    positive_int("nnodes", nnodes)
    positive_int("nproc_per_node", nproc_per_node)
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint must be HOST:PORT, got endpoint={endpoint!r}")
    launcher = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    command = launcher + ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    if rdzv_conf:
        command += ["--rdzv-conf", ",".join(f"{key}={value}" for key, value in rdzv_conf.items())]
    return command + ["-m", module, *args]


def format_command(command: Sequence[str]) -> str:
    """A command list as one shell line, quoted where needed."""
    return shlex.join(command)
