"""Run the chapters' key measurements on NVIDIA GPUs: ``python -m parallel_lib.check_gpu [--quick]``.

The notebooks and benchmarks run everywhere on CPU ranks and CPU "devices"; the
same code picks up GPUs when they are there (``launch`` chooses NCCL, int device
keys resolve to ``cuda:k``). This script is the one command a reader with GPUs
runs to see that happen, chapter by chapter, each printing its table:

``setup`` (00), ``dp`` (01), ``allreduce`` (02), ``model_parallel`` (03), ``pipeline`` (04),
``hybrid`` (05), ``sharding`` (06), ``tensor_parallel`` (07), ``schedules`` (08), ``inference``
(09), ``grid3d`` (10), ``context_parallel`` (11), ``expert_parallel`` (12) and ``serving`` (13);
``--only NAME`` runs chapter NN's ``parallel_lib/gpu_checks/chNN_NAME.py``,
and the printed plan says what each does and how many GPUs it needs.

The checks are a registry, :data:`parallel_lib.gpu_checks.CHECKS` (name -> chapter and check
function, one module per chapter in :mod:`parallel_lib.gpu_checks`): a later chapter adds its check
with one :func:`~parallel_lib.gpu_checks.register_check` line there; this module plans and runs them.
Every timer waits on the devices it timed, and only those
(:class:`~parallel_lib.common.timeline.DeviceClock`).

The report ends with each chapter's check, its status and its wall time in seconds, and
the total: on a GPU machine, the measured time per chapter.

A check that checked nothing is never a pass. Without a GPU the script says so and
exits with status 3, unless ``--allow-cpu`` is given: then it runs the same checks on
CPU devices (gloo ranks, int keys on the CPU) with the quick sizes, which is how the
tests smoke-run it. Exit status: 0 when every planned check passed; 1 when a check
failed; 2 for bad arguments; 3 when nothing could be checked here.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from parallel_lib import gpu_checks
from parallel_lib.common.models import GPT2_SIZES
from parallel_lib.common.tables import markdown_table
from parallel_lib.gpu_checks import device_counts, free_memory, workload_for
from parallel_lib.runtime.environment import environment_report

__all__ = ["Planned", "NOTHING_CHECKED", "plan", "format_plan", "parse_args", "main"]

NOTHING_CHECKED = 3  # exit status when no check could run (no GPU, or too few for the selected checks)
CPU_DEVICES = 2      # CPU "devices" (ranks, stages) of an --allow-cpu run without --gpus


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Planned:
    """One check as it will run here: on how many devices, or why it is skipped."""

    name: str
    gpus: int     # devices the check uses; 0 when skipped
    reason: str   # why it is skipped ("" when it runs)

    @property
    def runs(self) -> bool:
        return not self.reason


def plan(n_gpus: int, quick: bool = False, only: Optional[Sequence[str]] = None, kind: str = "GPU") -> list[Planned]:
    """Which checks run with ``n_gpus`` devices, in chapter order.

    Args:
        n_gpus: devices available to the checks.
        quick: plan for the quick workload (its model has fewer layers to split).
        only: run only these checks.
        kind: what a device is here, for the reasons: "GPU" or "CPU device".

    Raises:
        ValueError: a name in ``only`` that is not one of ``gpu_checks.CHECKS``.
    """
    unknown = [name for name in only or () if name not in gpu_checks.CHECKS]
    if unknown:
        raise ValueError(f"only must name checks from {list(gpu_checks.CHECKS)}, got {unknown}")
    n_layers = GPT2_SIZES[workload_for(quick).model]["n_layer"]
    planned = []
    for name, check in gpu_checks.CHECKS.items():
        if only and name not in only:
            planned.append(Planned(name, 0, "not selected (--only)"))
        elif n_gpus < check.min_devices:
            planned.append(Planned(name, 0, f"needs >= {check.min_devices} {kind}{'s' * (check.min_devices > 1)}, "
                                            f"found {n_gpus}"))
        else:
            used = max(device_counts(n_gpus, n_layers)) if check.splits_layers else n_gpus
            planned.append(Planned(name, used, ""))
    return planned


def format_plan(planned: Sequence[Planned]) -> str:
    """The plan as a Markdown table: check, chapter, devices, what it does or why it is skipped."""
    rows = [[p.name, gpu_checks.CHECKS[p.name].chapter, p.gpus if p.runs else "-",
             gpu_checks.CHECKS[p.name].what if p.runs else f"skipped: {p.reason}"] for p in planned]
    return markdown_table(["check", "chapter", "devices", "what"], rows, align="llrl")


# --------------------------------------------------------------------------- command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """``--quick``, ``--only NAME ...``, ``--gpus N`` and ``--allow-cpu``."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.check_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps and repeats: a smoke run")
    parser.add_argument("--only", nargs="+", choices=list(gpu_checks.CHECKS), metavar="CHECK",
                        help=f"run only these checks, from {list(gpu_checks.CHECKS)}")
    parser.add_argument("--gpus", type=int, help="use the first N GPUs (default: all visible); with "
                        f"--allow-cpu on a machine without GPUs, N CPU devices (default {CPU_DEVICES})")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, run the same checks on CPU "
                        "devices with the quick sizes instead of failing (a smoke test of this script)")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    return args


def _no_gpu_message() -> str:
    build = (f"this torch {torch.__version__} is built with CUDA {torch.version.cuda}, but no GPU is visible "
             "(check nvidia-smi and CUDA_VISIBLE_DEVICES)" if torch.version.cuda else
             f"this torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)")
    return (f"No NVIDIA GPU found: {build}. Nothing was checked on GPUs, so this is not a pass. The same runs "
            "on CPU: the notebooks, python -m parallel_lib.bench dp|allreduce|pp, and this script with "
            "--allow-cpu.")


def main(argv: Optional[list[str]] = None) -> int:
    """Run the planned checks one after another; 0 when all passed, 1 when one failed, 3 when none could run."""
    args = parse_args(argv)
    visible = torch.cuda.device_count()
    if visible == 0 and not args.allow_cpu:
        print(_no_gpu_message())
        return NOTHING_CHECKED
    if visible and args.gpus is not None and args.gpus > visible:
        print(f"--gpus {args.gpus} asks for more GPUs than the {visible} visible", file=sys.stderr)
        return 2
    kind = "GPU" if visible else "CPU device"
    count = args.gpus or (visible or CPU_DEVICES)
    quick = args.quick or not visible  # on the CPU: the quick sizes, a smoke run
    planned = plan(count, quick, args.only, kind)
    environment_report()
    print("\n" + format_plan(planned))
    if not any(p.runs for p in planned):
        print(f"\nNo check can run on {count} {kind}{'s' * (count > 1)}: nothing was checked, so this is not a pass.")
        return NOTHING_CHECKED
    outcomes = []
    for step in (p for p in planned if p.runs):
        check = gpu_checks.CHECKS[step.name]
        print(f"\n## {check.chapter}: {step.name} on {step.gpus} {kind}{'s' * (step.gpus > 1)}\n", flush=True)
        start = time.perf_counter()
        try:
            print(check.run(step.gpus, quick))
            status = "passed"
        except Exception:  # report it and go on: the other chapters' checks still tell something
            traceback.print_exc()
            status = "FAILED"
        free_memory()
        outcomes.append([step.name, check.chapter, status, f"{time.perf_counter() - start:.1f}"])
    # wall time per chapter's check, the figure to quote for "minutes per chapter on GPUs"
    print("\n" + markdown_table(["check", "chapter", "status", "wall seconds"], outcomes, align="lllr"))
    print(f"\ntotal wall time of the checks: {sum(float(row[3]) for row in outcomes):.1f} s on {count} {kind}"
          f"{'s' * (count > 1)}")
    return 1 if any(status == "FAILED" for _, _, status, _ in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
