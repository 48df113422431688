"""Rehearse a multi-node data-parallel job on one machine, and write its commands.

Going from ``launch`` in a notebook to ``torchrun`` on several hosts changes who
starts the processes and how they find each other (a c10d rendezvous at one
host's address), not what each rank computes. A rehearsal checks exactly that:
two ``torchrun`` launches on this machine play two "nodes" that meet on the
loopback interface, train the same :class:`~parallel_lib.data_parallel.DPConfig` as a
``launch`` of two ranks, and must end with the same parameters.

:func:`torchrun_command` writes the ``torchrun`` command line that every node
runs (the real multi-node one, or the loopback rehearsal), and this module's entry
point trains the small :data:`REHEARSAL` run and saves the result, one file per node::

    python -m parallel_lib.data_parallel.scaleout --out launch.pt              # 2 ranks from launch
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 --rdzv-id rehearsal -m parallel_lib.data_parallel.scaleout --out node0.pt
    (the same with --out node1.pt, in a second terminal)

The c10d rendezvous numbers nodes in the order it settles on, not the order they
were started, so each file records the rank it holds. The files are the ones
``python -m parallel_lib.data_parallel --save PATH`` writes, for the small :data:`REHEARSAL` run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Optional, Sequence

from parallel_lib.common.checks import positive_int
from parallel_lib.data_parallel.cli import save_run, saved_run
from parallel_lib.data_parallel.dp import SYNC_METHODS, DPConfig, run_dp
from parallel_lib.runtime.launcher import RankInfo, is_torchrun, run

__all__ = ["REHEARSAL", "torchrun_command", "format_command", "train_and_save", "main"]

# a few steps of the tiny model on a small slice of the corpus: seconds on one CPU core
REHEARSAL = DPConfig(model="tiny", batch_size=8, max_steps=3, train_examples=64, val_examples=8,
                     vocab_size=300, max_length=32, return_state=True)


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


def train_and_save(config: DPConfig, out: Optional[Path], world_size: Optional[int] = None,
                   threads_per_rank: Optional[int] = 1, timeout: float = 120.0) -> dict[str, object]:
    """Train ``config`` with :func:`~parallel_lib.data_parallel.run_dp` (launched here, or this torchrun rank).

    Args:
        config: the run; its final parameters are kept whatever ``return_state`` says.
        out: where this node's local rank 0 saves the result with ``torch.save`` (None: nowhere); the
            same file as ``python -m parallel_lib.data_parallel --save`` writes
            (:func:`~parallel_lib.data_parallel.cli.save_run`).
        world_size: ranks to launch outside torchrun (default 2); under torchrun None.
        threads_per_rank: torch threads per rank; equal thread counts give bit-equal
            results between a ``launch`` and a ``torchrun`` run.
        timeout: seconds for the launch, or for each collective under torchrun.

    Returns:
        :func:`~parallel_lib.data_parallel.cli.saved_run` of the rank this process is (0 outside
        torchrun): among others ``"rank"``, ``"world_size"``, every rank's ``"checksums"``, the job's
        ``"losses"`` per step and this rank's final ``"state"`` on the CPU.
    """
    if world_size is None and not is_torchrun():
        world_size = 2
    results = run(run_dp, world_size, replace(config, return_state=True),
                  threads_per_rank=threads_per_rank, timeout=timeout)
    if out is not None:
        save_run(results, out)  # one file per node
    return saved_run(results, RankInfo.from_env().rank if is_torchrun() else 0)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m parallel_lib.data_parallel.scaleout [--out PATH]``, also as every rank of a torchrun job."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.data_parallel.scaleout", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="file for this node's result (torch.save)")
    parser.add_argument("--sync", choices=SYNC_METHODS, default=REHEARSAL.sync)
    parser.add_argument("--steps", type=int, default=REHEARSAL.max_steps, help="training steps")
    parser.add_argument("--world-size", type=int, help="ranks to launch (default 2; torchrun decides under torchrun)")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the launch or each collective")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    saved = train_and_save(replace(REHEARSAL, sync=args.sync, max_steps=args.steps), args.out,
                           args.world_size, args.threads_per_rank, args.timeout)
    if not is_torchrun() or RankInfo.from_env().local_rank == 0:  # one line per node
        checksums = saved["checksums"]
        assert isinstance(checksums, list)
        print(f"rank {saved['rank']} of {saved['world_size']}: parameter checksum {checksums[saved['rank']]!r}, "
              f"all ranks equal: {len(set(checksums)) == 1}" + (f", saved to {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    # through the package's module, as in parallel_lib.runtime: one copy of run_dp and DPConfig
    from parallel_lib.data_parallel.scaleout import main as _main

    sys.exit(_main())
