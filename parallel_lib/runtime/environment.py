"""What this notebook runs on, and a first all-reduce to prove the set-up works.

    python -m parallel_lib.runtime --world-size 2
    torchrun --standalone --nproc-per-node 2 -m parallel_lib.runtime
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
from typing import Any

import torch
import torch.distributed as dist

from parallel_lib.runtime.device import cpu_count, rank_device
from parallel_lib.runtime.launcher import BACKENDS, RankInfo, is_torchrun, run

__all__ = ["environment_info", "environment_report", "machine_label", "all_reduce_demo", "main"]


def environment_info() -> dict[str, Any]:
    """What this process runs on, as data (for reports and benchmark records)."""
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    gpus = [(p.name, p.total_memory / 2**30) for p in props]  # (name, GiB)
    return dict(python=platform.python_version(), system=platform.system(),
                platform=platform.platform(terse=True), torch=torch.__version__,
                cuda=torch.version.cuda, transformers=version("transformers"),
                tokenizers=version("tokenizers"), cpu_count=cpu_count(), gpus=gpus,
                nccl=dist.is_available() and dist.is_nccl_available())


def machine_label(info: dict[str, Any] | None = None) -> str:
    """A short label for measured numbers, e.g. "2-core CPU (Linux, no GPU)"."""
    info = info or environment_info()
    cpu = f"{info['cpu_count']}-core CPU"
    if not info["gpus"]:
        return f"{cpu} ({info['system']}, no GPU)"
    names = [name for name, _ in info["gpus"]]
    gpus = ", ".join(f"{names.count(name)}× {name}" for name in dict.fromkeys(names))
    return f"{gpus} + {cpu} ({info['system']})"


def environment_report() -> None:
    """Print what this notebook will run on: versions, cores, GPUs and launch's backend."""
    info = environment_info()
    gpus = [f"cuda:{i} {name} ({memory:.1f} GiB)" for i, (name, memory) in enumerate(info["gpus"])]
    n_gpus = len(info["gpus"])
    if n_gpus and info["nccl"]:
        backend = f"nccl for up to {n_gpus} ranks (one GPU each), gloo on the CPU beyond"
    else:
        backend = "gloo on the CPU (loopback), each rank on its share of the cores"
    rows = [("python", f"{info['python']} on {info['platform']}"),
            ("torch", f"{info['torch']} (CUDA {info['cuda'] or 'not built in'})"),
            ("transformers", info["transformers"]),
            ("CPU cores", str(info["cpu_count"])),
            ("GPUs", "; ".join(gpus) or "none"),
            ("launch() uses", backend),
            ("machine label", machine_label(info))]
    print("\n".join(f"{key:<14} {value}" for key, value in rows))


def all_reduce_demo(rank: int, world_size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Each rank holds ``[rank + 1, rank + 1]`` and all-reduces it with SUM.

    Returns:
        ``(rank, tensor before, tensor after)``; after is ``world_size * (world_size + 1) / 2``
        everywhere, on every rank.
    """
    tensor = torch.full((2,), float(rank + 1), device=rank_device())
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return rank, before, tensor


def main(argv: list[str] | None = None) -> int:
    """Check the set-up: all-reduce across ranks, launched here or by torchrun; 0 if correct."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to launch (default 2; torchrun decides under torchrun)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    world_size = args.world_size if is_torchrun() else args.world_size or 2
    results = run(all_reduce_demo, world_size, backend=args.backend, timeout=args.timeout)
    if is_torchrun() and RankInfo.from_env().rank != 0:
        return 0  # every rank holds all results; one of them reports
    environment_report()
    expected = len(results) * (len(results) + 1) / 2
    for rank, before, after in results:
        print(f"rank {rank}: {before.tolist()} -> all_reduce(SUM) -> {after.tolist()}")
    correct = all(bool((after == expected).all()) for _, _, after in results)
    print(f"all_reduce {'OK' if correct else 'WRONG'}: expected {expected:g} on each of "
          f"{len(results)} ranks")
    return 0 if correct else 1
