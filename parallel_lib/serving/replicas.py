"""Data-parallel serving: N replica engines behind one router, each request sent to the least-loaded one.

Tensor parallelism splits one model over devices to make each step faster (or to fit the model);
data parallelism keeps a whole copy per device and serves more requests at once. vLLM's
data-parallel mode and SGLang's router put a front end before N engines; the front end decides,
per request, which engine serves it. Here the :class:`ReplicaRouter` holds N
:class:`~parallel_lib.serving.engine.ServingEngine` replicas and routes each arriving request to
the least-loaded one::

    add(request) ─ router: the replica with the least load ─ replica k's scheduler (continuous batching)
    step()       ─ every busy replica steps once: one forward pass each

**Load.** ``policy="sequences"`` counts a replica's sequences, running and waiting (SGLang's
"shortest queue"); ``policy="blocks"`` counts the blocks a replica holds plus those its waiting
requests will need, so a replica full of long requests looks busier than one with many short
ones (the memory view, vLLM's). Ties go to the replica with more free blocks, then the lower
index: routing is deterministic.

**Same tokens.** A replica is the single engine on its own pool; a request's tokens depend on
nothing but its prompt, its settings and its own seeded random stream (chapter 09's rule), so
they are the single engine's whichever replica serves it, whatever else runs beside it.

**Replicas in one process.** The replicas live in this process, one per device given (on a CPU
all of them on the CPU, sharing the read-only weights): the router then sees each replica's load
directly, with no message per request and no rank to start, which is what the chapter needs to
show the routing and the token identity. Replicas on ranks (chapter 09's ``dp`` strategy
partitions the requests over ranks) would add, per request, a message to the rank and, per step,
the replicas' loads back to the router, for the same tokens.

**Stepping.** By default the replicas step one after another, and a step waits for its logits
before the next replica's starts: N replicas then do the work of one engine with N times the batch,
in N times as many forward passes. With ``threads=True`` each busy replica steps in a thread of its
own and the router waits for all of them (at most ``timeout`` seconds): replicas on several GPUs
then compute at once (PyTorch releases Python's lock while a kernel runs and while it waits for
one), which is where data-parallel serving's throughput comes from. On one CPU the threads share
its cores and gain little.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any, Optional, Sequence as Seq

import torch

from parallel_lib.common.checks import check_choice, positive_int, positive_number
from parallel_lib.inference.batch import Request, Result, check_requests
from parallel_lib.models.hf import as_gpt2
from parallel_lib.serving.block_manager import blocks_for
from parallel_lib.serving.engine import ServingEngine, StepRecord, run_to_completion

__all__ = ["POLICIES", "ReplicaRouter"]

POLICIES = ("sequences", "blocks")


class ReplicaRouter:
    """N serving engines behind one router; see the module docstring.

    Args:
        model: the one GPT-2 or a Hugging Face ``GPT2LMHeadModel``.
        replicas: how many engines (ignored when ``devices`` is given: one per device).
        num_blocks, block_size, max_batch, prefix_caching, max_step_tokens: every replica's
            :class:`~parallel_lib.serving.engine.ServingEngine` settings (its own pool of ``num_blocks``).
        policy: ``"sequences"`` or ``"blocks"``: what "least loaded" counts.
        devices: a device per replica; each gets a copy of the model there (None: every replica on the
            model's device, sharing its weights).
        threads: step the busy replicas at once, a thread each (see the module docstring).
        timeout: seconds the router waits for a step of the replicas' threads.

    Raises:
        TypeError: ``devices`` is not a list.
        ValueError: ``replicas`` below 1, an empty ``devices``, an unknown ``policy``, a ``timeout`` not above 0,
            or a bad engine setting.
    """

    def __init__(self, model: Any, replicas: int = 2, num_blocks: int = 64, block_size: int = 16, max_batch: int = 8,
                 prefix_caching: bool = False, max_step_tokens: Optional[int] = None, policy: str = "sequences",
                 devices: Optional[Seq[Any]] = None, threads: bool = False, timeout: float = 60.0) -> None:
        self.policy = check_choice("policy", policy, POLICIES)
        self.threads, self.timeout = bool(threads), positive_number("timeout", timeout)
        model = as_gpt2(model)
        if devices is None:
            models = [model] * positive_int("replicas", replicas)
        else:
            if isinstance(devices, (str, torch.device)) or not isinstance(devices, (list, tuple)):
                raise TypeError(f"devices must be a list of devices (one replica each), got {devices!r}")
            if not devices:
                raise ValueError("devices must name at least one device, got []; pass None to keep the model's device")
            models = [copy.deepcopy(model).to(torch.device(d)) for d in devices]
        self.engines = [ServingEngine(m, num_blocks, block_size, max_batch, prefix_caching, max_step_tokens)
                        for m in models]
        self.assignment: dict[int, int] = {}  # request index -> replica
        self._pool: Optional[ThreadPoolExecutor] = None
        self.results: dict[int, Result] = {}

    def __len__(self) -> int:
        return len(self.engines)

    def load(self, replica: int) -> tuple[int, int]:
        """``(load, -free blocks)`` of ``replica``: smaller is less loaded (see the module docstring).

        Raises:
            ValueError: no such replica.
        """
        if not isinstance(replica, int) or not 0 <= replica < len(self.engines):
            raise ValueError(f"replica must be an index in 0..{len(self.engines) - 1}, got replica={replica!r}")
        engine = self.engines[replica]
        scheduler, blocks = engine.scheduler, engine.blocks
        if self.policy == "sequences":
            load = len(scheduler.running) + len(scheduler.waiting)
        else:
            load = blocks.num_used() + sum(blocks_for(len(s.tokens), blocks.block_size) for s in scheduler.waiting)
        return load, -blocks.num_free()

    def route(self) -> int:
        """The replica the next request goes to: the least loaded, ties to the lower index."""
        return min(range(len(self.engines)), key=lambda k: (*self.load(k), k))

    def add(self, request: Request, index: Optional[int] = None, arrival: Optional[float] = None) -> int:
        """Route ``request`` to the least-loaded replica and queue it there; returns its index.

        Args:
            request, arrival: as :meth:`ServingEngine.add <parallel_lib.serving.engine.ServingEngine.add>`.
            index: its index across all replicas (default: the next free one); must be new.

        Raises:
            TypeError, ValueError: as ServingEngine.add; ``index`` taken on any replica.
        """
        check_requests([request], self.engines[0].n_positions)
        index = len(self.results) if index is None else index
        if index in self.results:
            raise ValueError(f"index={index} is already a request of this router; give each request its own index")
        replica = self.route()
        self.engines[replica].add(request, index, arrival)
        self.assignment[index] = replica
        self.results[index] = self.engines[replica].results[index]
        self.results[index].served_by = f"replica {replica} ({self.results[index].served_by or 'refused'})"
        return index

    def idle(self) -> bool:
        """No replica has anything waiting or running."""
        return all(engine.idle() for engine in self.engines)

    def step(self) -> list[Optional[StepRecord]]:
        """One step of every busy replica (None for an idle one); with ``threads``, all at once.

        Raises:
            TimeoutError: with ``threads``, a replica's step took longer than ``timeout`` (naming it).
        """
        busy = [k for k, engine in enumerate(self.engines) if not engine.idle()]
        records: list[Optional[StepRecord]] = [None] * len(self.engines)
        if not self.threads or len(busy) < 2:
            for k in busy:
                records[k] = self.engines[k].step()
            return records
        if self._pool is None:  # one thread per replica, kept until close()
            self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="replica")
        futures = {k: self._pool.submit(self.engines[k].step) for k in busy}
        for k, future in futures.items():  # a timeout returns at once: nothing waits for the late thread
            try:
                records[k] = future.result(timeout=self.timeout)
            except FutureTimeout:
                raise TimeoutError(f"replica {k}: its step took more than timeout={self.timeout:g} s") from None
        return records

    def close(self) -> None:
        """Let the replicas' threads go (idempotent; a later threaded step starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __enter__(self) -> ReplicaRouter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, requests: Seq[Request]) -> list[Result]:
        """Add ``requests`` (routed one by one, in order) and step every replica until all are done.

        Raises:
            TypeError, ValueError: as :meth:`add` (checked for every request before any is routed).
        """
        return run_to_completion(self, requests, self.engines[0].n_positions)

    def served(self) -> list[int]:
        """Requests each replica was given, by replica."""
        counts = [0] * len(self.engines)
        for replica in self.assignment.values():
            counts[replica] += 1
        return counts
