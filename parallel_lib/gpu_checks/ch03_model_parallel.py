"""Chapter 03's GPU check: GPT-2 over ``cuda:0 .. cuda:k-1`` by a device map has one GPU's gradients.

:func:`check_model_parallel` splits GPT-2 over 1, 2, 4, ... devices with chapter 03's device
map, compares the loss and every gradient with one device, and times AdamW steps (tokens/s).
:mod:`parallel_lib.gpu_checks` registers it as ``model_parallel``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from parallel_lib.common.tables import markdown_table
from parallel_lib.common.training import train
from parallel_lib.gpu_checks._reference import (Batch, Grads, device_counts, free_memory, loss_and_grads,
                                                max_difference, one_device_reference, workload_for)
from parallel_lib.model_parallel.device_map import get_device_map
from parallel_lib.model_parallel.placing import parallelize
from parallel_lib.runtime.device import resolve_device

__all__ = ["check_model_parallel"]


def _model_parallel_row(reference: nn.Module, expected: Grads, batches: list[Batch], k: int) -> list[object]:
    """GPT-2 split over ``k`` devices: (devices, layers per device, max grad difference, tokens/s)."""
    device_map = get_device_map(reference.config.n_layer, list(range(k)))
    model = parallelize(copy.deepcopy(reference), device_map)
    first = resolve_device(0)
    difference = max_difference(expected, loss_and_grads(model, batches[0], first), f"{k} devices")
    record = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, progress=False, device=first)
    devices = ", ".join(str(resolve_device(key)) for key in device_map)
    layers = "+".join(str(len(v)) for v in device_map.values())
    return [devices, layers, f"{difference:.1e}", record.throughput(skip=1)]  # step 0 warms up kernels


def check_model_parallel(n_gpus: int, quick: bool = False) -> str:
    """GPT-2 split over 1, 2, 4, ... devices by a device map: same gradients as one device, tokens/s."""
    workload = workload_for(quick)
    batches, reference, expected = one_device_reference(workload)
    rows = []
    for k in device_counts(n_gpus, reference.config.n_layer):
        rows.append(_model_parallel_row(reference, expected, batches, k))  # the split model is freed on return
        free_memory()
    baseline = rows[0][3]
    table = markdown_table(["devices", "layers per device", "max abs grad diff vs 1 device", "target tokens/s",
                            "× 1 device"],
                           [row[:3] + [f"{row[3]:,.0f}", f"{row[3] / baseline:.2f}×"] for row in rows], "llrrr")
    return "\n".join([f"Model parallelism, GPT-2 ({workload.model}) split by get_device_map, {workload.rows} rows x "
                      f"{workload.length} positions, AdamW, {workload.steps} timed steps.", "", table])
