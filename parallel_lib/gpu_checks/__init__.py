"""The chapters' GPU checks, one module per chapter, and the registry ``python -m parallel_lib.check_gpu`` runs.

Each check runs its chapter's key result on the devices it is given (NCCL ranks, ``cuda:N``
devices) and returns its table(s) as Markdown: the equivalence with one device or one process
(a ``CheckError`` when it does not hold), then the chapter's measurement. The same functions run
on CPU "devices" (gloo ranks, int device keys on a machine without GPUs), which is how the tests
check them. Chapter NN's check, registered as ``NAME``, lives in ``chNN_NAME.py`` (``--only grid3d``
runs ``ch10_grid3d.check_grid3d``); what several checks share (the workload, the one-device
reference, the gradient comparison, freeing memory) lives in ``_reference.py``.

:data:`CHECKS` maps each check's name (what ``--only`` takes) to its chapter and function, in
chapter order; a later chapter adds its check with one :func:`register_check` line below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from parallel_lib.gpu_checks._reference import (FULL, QUICK, CheckError, Workload, device_counts, free_memory,
                                                workload_for)
from parallel_lib.gpu_checks.ch00_setup import check_setup
from parallel_lib.gpu_checks.ch01_dp import check_dp
from parallel_lib.gpu_checks.ch02_allreduce import check_allreduce
from parallel_lib.gpu_checks.ch03_model_parallel import check_model_parallel
from parallel_lib.gpu_checks.ch04_pipeline import check_pipeline
from parallel_lib.gpu_checks.ch05_hybrid import check_hybrid
from parallel_lib.gpu_checks.ch06_sharding import check_sharding
from parallel_lib.gpu_checks.ch07_tensor_parallel import check_tensor_parallel
from parallel_lib.gpu_checks.ch08_schedules import check_schedules
from parallel_lib.gpu_checks.ch09_inference import check_inference
from parallel_lib.gpu_checks.ch10_grid3d import check_grid3d
from parallel_lib.gpu_checks.ch11_context_parallel import check_context_parallel
from parallel_lib.gpu_checks.ch12_expert_parallel import check_expert_parallel
from parallel_lib.gpu_checks.ch13_serving import check_serving

__all__ = ["Check", "CHECKS", "register_check", "CheckError", "Workload", "FULL", "QUICK", "workload_for",
           "device_counts", "free_memory"]


@dataclass(frozen=True)
class Check:
    """One chapter's check.

    Attributes:
        chapter: the notebook it stands for, e.g. ``"01_data_parallel"``.
        min_devices: GPUs it needs (CPU devices with ``--allow-cpu``).
        what: one line for the plan.
        run: ``run(n_devices, quick)`` returns the chapter's table(s) as Markdown and raises
            (``CheckError``) when the result is wrong.
        splits_layers: the check cuts one model's layers over its devices, so it uses at
            most one device per layer.
    """

    chapter: str
    min_devices: int
    what: str
    run: Callable[[int, bool], str]
    splits_layers: bool = False


CHECKS: dict[str, Check] = {}  # name (what --only takes) -> check, in chapter order


def register_check(name: str, check: Check) -> Check:
    """Add a chapter's check to :data:`CHECKS`; ``python -m parallel_lib.check_gpu`` then runs it.

    Args:
        name: what ``--only`` takes, e.g. ``"dp"``.
        check: the chapter, device count, plan line and function.

    Returns:
        ``check``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    if name in CHECKS:
        raise ValueError(f"a check named {name!r} is already registered (for {CHECKS[name].chapter}); "
                         "choose another name")
    CHECKS[name] = check
    return check


# one line per chapter; a later chapter registers its own check the same way
register_check("setup", Check("00_setup_and_devices", 1, "an all-reduce over NCCL ranks; the tiny GPT-2's first "
                              "run on cuda:0", check_setup))
register_check("dp", Check("01_data_parallel", 2, "data parallel on NCCL ranks: equivalence with one process, "
                           "bench dp", check_dp))
register_check("allreduce", Check("02_all_reduce", 2, "ring vs dist.all_reduce on NCCL: bench allreduce",
                                  check_allreduce))
register_check("model_parallel", Check("03_model_parallel", 1, "GPT-2 over cuda:0..k-1 device maps: equivalence "
                                       "with one GPU, tokens/s", check_model_parallel, splits_layers=True))
register_check("pipeline", Check("04_pipeline_parallel", 2, "Pipe over cuda:0..p-1: equivalence with one GPU, "
                                 "step times by m, bench pp", check_pipeline, splits_layers=True))
register_check("hybrid", Check("05_choosing_a_strategy", 2, "DP over pipelines on NCCL ranks: equivalence "
                               "with one process", check_hybrid))
register_check("sharding", Check("06_sharded_data_parallel", 2, "ZeRO-0..3, ZeroRedundancyOptimizer, FSDP2 on NCCL "
                                 "ranks: equivalence with one process, census, bench sharding", check_sharding))
register_check("tensor_parallel", Check("07_tensor_parallel", 2, "GPT-2 split by heads (TP, TP+SP, x DP) on NCCL "
                                        "ranks: equivalence with one process", check_tensor_parallel))
register_check("schedules", Check("08b_v_shapes_and_hangs", 2, "every chapter 08 schedule's Pipe over cuda:0, "
                                  "cuda:1: equivalence with one GPU, step times", check_schedules, splits_layers=True))
register_check("inference", Check("09_inference", 1, "serving on cuda:0, cuda:0..n-1 and NCCL ranks (dp, pp, tp): "
                                  "the CPU engine's tokens", check_inference))
register_check("grid3d", Check("10_training_at_scale", 2, "DP x TP x PP on NCCL ranks: equivalence with one "
                               "process, every group's traffic vs the formula", check_grid3d))
register_check("context_parallel", Check("11_long_context", 2, "ring (both layouts) and Ulysses attention on NCCL "
                                         "ranks vs full attention, GPT-2 with ring attention, PyTorch's "
                                         "context_parallel beside them, memory per rank by length",
                                         check_context_parallel))
register_check("expert_parallel", Check("12_mixture_of_experts", 2, "mixture of experts over NCCL ranks (ep): "
                                        "equivalence with one process, all-to-all bytes vs the formula, load with "
                                        "and without the balancing loss", check_expert_parallel))
register_check("serving", Check("13_serving_engine", 1, "the paged engine on cuda:0 (continuous, chunked, "
                                "speculative), greedy: Hugging Face generate's tokens on the same device",
                                check_serving))
