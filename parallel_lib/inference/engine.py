"""The generation engine: prefill, then one token at a time, over stages that own a KV cache each.

An :class:`Engine` holds one or more :class:`~parallel_lib.inference.stage.Stage` in this
process, in order (one for ``single``, ``dp`` and ``tp``; one per device for ``mp``), and one
preallocated :class:`~parallel_lib.inference.kv_cache.KVCache` per stage. ``generate`` serves a
list of requests in groups of at most ``max_batch``, one group after another::

    step 0 (prefill):  every prompt at once          -> each request's first token
    step t (decode):   each request's token t-1 in   -> token t, until every request is done

Each request gets a :class:`~parallel_lib.inference.batch.Result`: its tokens (or its error),
the time of each token and its timeline events; the engine also records one event per stage
and step (lane = the stage's device), which shows which device works when.

**Failure isolation.** A request whose prompt holds a token id outside the vocabulary is found
when it is admitted: its result carries the error and the others are served without it. A row
whose logits cannot be sampled stops with its error; its neighbours go on. Mistakes in the
call itself (no requests, a prompt longer than the context, a batch larger than the cache)
raise before anything runs.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch

from parallel_lib.common.checks import positive_int
from parallel_lib.common.timeline import DeviceClock, Event, TimelineRecorder
from parallel_lib.inference.batch import Group, Request, Result, StepInput, check_requests
from parallel_lib.inference.kv_cache import KVCache
from parallel_lib.inference.stage import Stage, build_stage
from parallel_lib.models.hf import as_gpt2
from parallel_lib.model_parallel.device_map import DeviceKey, get_device_map, lane_name
from parallel_lib.runtime.collectives import CollectiveCounter, count_collectives
from parallel_lib.runtime.device import resolve_device

__all__ = ["Engine", "admit"]


def admit(requests: Sequence[Request], indices: Sequence[int], vocab_size: int) -> tuple[list[int], list[Result]]:
    """Split requests into the admitted (their positions in ``requests``) and the refused (a Result with the error).

    A prompt token outside ``0 .. vocab_size - 1`` would make the embedding fail for the whole
    batch; found here, it fails its own request only.
    """
    admitted, refused = [], []
    for pos, (index, request) in enumerate(zip(indices, requests)):
        bad = [t for t in request.prompt if not 0 <= t < vocab_size]
        if bad:
            refused.append(Result(index, error=f"request {index}: prompt token id(s) {bad[:4]} outside the "
                                               f"vocabulary 0..{vocab_size - 1}; not served"))
        else:
            admitted.append(pos)
    return admitted, refused


class Engine:
    """Stages in one process with a KV cache each; see the module docstring.

    Args:
        stages: the model's pieces, in order (the first embeds, the last gives logits).
        max_batch: requests served at once (the caches' batch).
        max_len: cache slots per request (default: the model's ``n_positions``).
        n_positions, vocab_size: the model's context and vocabulary.
        dtype: of the caches (the model's).
        count_collectives: record the collectives of every forward pass in :attr:`collectives`
            (tensor parallelism: the test that each decoded token costs 2 all-reduces per layer).

    Raises:
        ValueError: no stages, or stages that do not start with the embedding and end with the head.
    """

    def __init__(self, stages: Sequence[Stage], max_batch: int, n_positions: int, vocab_size: int,
                 max_len: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 count_collectives: bool = False) -> None:
        self.stages = list(stages)
        if not self.stages or not self.stages[0].first or not self.stages[-1].last:
            raise ValueError("stages must start with the embedding and end with the head (build_stage(first=..., "
                             "last=...))")
        self.max_batch = positive_int("max_batch", max_batch)
        self.n_positions, self.vocab_size = n_positions, vocab_size
        self.max_len = positive_int("max_len", max_len if max_len is not None else n_positions)
        self.caches: list[KVCache] = [s.new_cache(self.max_batch, self.max_len, dtype) for s in self.stages]
        self.recorder = TimelineRecorder(DeviceClock([s.device for s in self.stages]))
        self.device_events: list[Event] = []  # lane = stage, micro_batch = the group's number
        self.groups: list[list[int]] = []      # the request indices of each group served, in order
        self.count_collectives = count_collectives
        self.collectives: list[tuple[int, CollectiveCounter]] = []  # (step, what this rank issued in the pass)

    @classmethod
    def single(cls, model: Any, max_batch: int = 8, max_len: Optional[int] = None,
               device: DeviceKey = "cpu") -> Engine:
        """The whole model on one device."""
        return cls.model_parallel(model, [device], max_batch, max_len)

    @classmethod
    def model_parallel(cls, model: Any, devices: Sequence[DeviceKey], max_batch: int = 8,
                       max_len: Optional[int] = None) -> Engine:
        """Layers spread over ``devices`` by chapter 03's :func:`get_device_map` (int keys: GPUs, or the CPU without).

        The hidden state moves to the next stage's device between stages; one stage works at a time.
        """
        model = as_gpt2(model)  # converted once, not once per stage
        config = model.config
        device_map = get_device_map(config.n_layer, devices)
        keys = [k for k, layers in device_map.items() if layers]
        stages: list[Stage] = []
        for n, key in enumerate(keys):
            stages.append(build_stage(model, device_map[key], resolve_device(key), first=n == 0,
                                      last=n == len(keys) - 1, lane=lane_name(key),
                                      tied_to=stages[0].wte if stages else None))  # tied head
        return cls(stages, max_batch, config.n_positions, config.vocab_size, max_len, next(model.parameters()).dtype)

    def kv_bytes(self) -> int:
        """Bytes of every stage's KV cache (storage census)."""
        return sum(c.nbytes() for c in self.caches)

    def forward(self, step: StepInput, index: int = 0, group: int = 0) -> torch.Tensor:
        """Step ``index`` of group ``group`` through every stage; returns the logits (b, V) on the CPU.

        Each stage's work is one event on its lane; with ``count_collectives`` set, the collectives
        this rank issued in the pass are appended to :attr:`collectives` as ``(step index, counter)``.
        """
        counting = count_collectives() if self.count_collectives else nullcontext(None)
        with counting as counter:
            x = step.ids
            for stage, cache in zip(self.stages, self.caches):
                start = self.recorder.now()
                x = stage(step, x, cache)
                self.device_events.append(Event(stage.lane, "decode" if index else "prefill", group, start,
                                                self.recorder.now(), f"g{group}"))
        if counter is not None:
            self.collectives.append((index, counter))
        return x.float().cpu()

    def generate(self, requests: Sequence[Request], indices: Optional[Sequence[int]] = None) -> list[Result]:
        """Serve ``requests``; one Result per request, in order (see the module docstring).

        Args:
            requests: the requests.
            indices: their indices in the whole job (default ``0..n-1``): the lanes' and results' names.

        Raises:
            ValueError, TypeError: bad requests (see :func:`check_requests`), or one that needs more
                cache slots than ``max_len``.
        """
        requests = check_requests(requests, self.n_positions)
        indices = list(range(len(requests))) if indices is None else list(indices)
        for i, r in zip(indices, requests):
            if r.slots > self.max_len:
                raise ValueError(f"request {i} needs {r.slots} cache slots (prompt + max_new_tokens - 1), more than "
                                 f"the engine's max_len={self.max_len}; build the engine with a larger max_len")
        admitted, refused = admit(requests, indices, self.vocab_size)
        results = {r.index: r for r in refused}
        arrival = self.recorder.now()
        for start in range(0, len(admitted), self.max_batch):
            chosen = admitted[start:start + self.max_batch]
            group = Group([requests[p] for p in chosen], [indices[p] for p in chosen])
            self.groups.append(group.indices)
            for result in self.run_group(group, len(self.groups) - 1):
                result.arrival, result.served_by = arrival, "+".join(s.lane for s in self.stages)
                results[result.index] = result
        return [results[i] for i in indices]

    def run_group(self, group: Group, number: int = 0) -> list[Result]:
        """Prefill then decode one group (the ``number``-th) until every request in it is done.

        Raises:
            ValueError: the group has more requests than the cache has rows, or needs more slots.
        """
        for cache in self.caches:
            cache.check_fits(len(group), group.max_len)
        start = self.recorder.now()
        tokens = group.accept(0, self.forward(group.prefill(), 0, number), start, self.recorder.now())
        for step in range(1, group.steps):
            if group.done(step):
                break
            start = self.recorder.now()
            tokens = group.accept(step, self.forward(group.decode(step, tokens), step, number), start,
                                  self.recorder.now())
        return group.results
