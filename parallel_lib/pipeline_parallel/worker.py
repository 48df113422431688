"""Worker threads: one per pipeline stage, each fed tasks on its own in-queue.

Why threads and not processes: stages exchange activations every micro-batch, and
in one process that is a pointer hand-over, not a copy through a socket. Threads
run side by side because PyTorch releases the GIL inside its kernels (and CUDA
calls from different threads overlap). Why one thread per stage, not a pool: a
stage's actions must run in the schedule's order, and CUDA/autograd state is
simplest when one stage always lives on one thread.

A :class:`Task` is a closure plus the (stage, action) it belongs to. Workers never
look inside it: they run it and answer ``(task, ok, result or exc_info)`` on the
out-queue, also for a ``BaseException`` such as ``KeyboardInterrupt`` (a thread that
died of it would leave the caller waiting for its timeout). After :meth:`Workers.cancel`
queued tasks are answered without running (``ok`` False, no exc_info): a failed step
stops at once instead of computing what nobody will use. The
:class:`~parallel_lib.pipeline_parallel.Pipe` gives each worker one task per step, its rank's whole
action list (:func:`~parallel_lib.pipeline_parallel.runtime.run_actions`), whose actions
:meth:`Workers.report` as they end. All workers answer on one shared out-queue, so the caller
wakes up on whichever stage finishes first instead of polling p queues.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from queue import Empty, Queue
from types import TracebackType
from typing import Any, Callable, Optional, Sequence, Union

import torch

from parallel_lib.common.timeline import TimelineRecorder
from parallel_lib.pipeline_parallel.schedule import Action, stage_lane

__all__ = ["Task", "Workers", "THREAD_PREFIX"]

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]
Answer = tuple["Task", bool, Union[Any, ExcInfo, None]]

THREAD_PREFIX = "pipe-stage-"  # worker thread names; tests look for leftovers by this prefix
_IDLE_POLL_S = 1.0  # an idle worker re-checks its stop flag this often


@dataclass
class Task:
    """How to run one action of one stage; ``compute`` runs on the stage's worker thread.

    Attributes:
        stage: index j of the stage (the rank: its worker thread runs the task).
        action: ``F(i)``, ``B(i)`` or ``W(i)``, possibly of another model stage the rank holds.
        compute: the work; its return value travels back on the out-queue.
        grad_mode: autograd's grad mode for ``compute`` (grad mode is per thread, so
            the caller's ``torch.no_grad()`` must be handed over explicitly).
        recorder: when given, ``compute`` is recorded as one timeline event.
        device: the stage's device, where the task's time stamps are taken: on a GPU, CUDA
            events on its current stream (the recorder must time it), read after the step, so
            no stage waits for its device and the stages overlap as they do untimed; on a CPU,
            the host clock.
    """

    stage: int
    action: Optional[Action]  # None: a rank's whole action list (the Pipe's worker runs its loop)
    compute: Callable[[], Any]
    grad_mode: bool
    recorder: Optional[TimelineRecorder] = None
    device: Optional[torch.device] = None
    label: str = ""  # the event's label: "W" for a weight gradient, "s<stage>" on a rank of several stages

    def run(self) -> Any:
        with torch.set_grad_enabled(self.grad_mode):
            if self.recorder is None:
                return self.compute()
            start = self.recorder.stamp(self.device)
            try:
                return self.compute()
            finally:
                self.recorder.add_stamped(stage_lane(self.stage), self.action.event_kind, self.action.micro_batch,
                                          start, self.recorder.stamp(self.device), self.label)


def _serve_one(in_queue: Queue, out_queue: Queue, cancelled: threading.Event) -> bool:
    """Run the next task, if one comes within the idle poll; False on the ``None`` sentinel.

    A function of its own so that nothing of the last micro-batch (the task holds its
    tensors) stays referenced while the worker waits for the next task.
    """
    try:
        task = in_queue.get(timeout=_IDLE_POLL_S)
    except Empty:
        return True
    if task is None:
        return False
    if cancelled.is_set():
        out_queue.put((task, False, None))
        return True
    try:
        answer: Answer = (task, True, task.run())
    except BaseException:  # KeyboardInterrupt, SystemExit too: the caller reports it at once
        cancelled.set()  # early stop, before this or another worker picks up its next task
        answer = (task, False, sys.exc_info())
    out_queue.put(answer)
    return True


def _worker_loop(device: torch.device, num_threads: int, in_queue: Queue, out_queue: Queue,
                 stop: threading.Event, cancelled: threading.Event) -> None:
    """Run tasks until a ``None`` sentinel arrives or ``stop`` is set."""
    torch.set_num_threads(num_threads)  # intra-op threads are per thread: p stages share the cores
    if device.type == "cuda":
        torch.cuda.set_device(device)
    while not stop.is_set() and _serve_one(in_queue, out_queue, cancelled):
        pass


class Workers:
    """p stage threads with one in-queue each and a shared out-queue.

    Threads start on :meth:`start` and stop on :meth:`close`; a closed ``Workers`` can be
    started again, with fresh queues. A thread that does not stop within ``close``'s
    timeout (stuck in a long task: Python cannot kill a thread) is kept as a *leftover*:
    it may still write gradients, so :meth:`start` refuses to start while one is alive.

    Args:
        devices: the device of each stage (CUDA workers make it their current device).
        num_threads: ``torch.set_num_threads`` inside every worker.
    """

    def __init__(self, devices: Sequence[torch.device], num_threads: int = 1) -> None:
        self.devices = list(devices)
        self.num_threads = num_threads
        self._threads: list[threading.Thread] = []
        self._leftovers: list[threading.Thread] = []
        self._in_queues: list[Queue] = []
        self._out_queue: Queue = Queue()
        self._stop = threading.Event()
        self._cancelled = threading.Event()

    def start(self) -> None:
        """Start the worker threads unless they are running.

        Raises:
            RuntimeError: a leftover thread is still running. Waiting for it here would let it
                write into gradients the caller may have zeroed for this call.
        """
        if self._threads:
            return
        self._leftovers = [t for t in self._leftovers if t.is_alive()]
        if self._leftovers:
            names = ", ".join(t.name for t in self._leftovers)
            raise RuntimeError(f"{names} from an earlier call is still running (a task that timed out or was "
                               f"interrupted) and may still write gradients; this Pipe refuses to run until it "
                               f"ends: retry in a moment, and zero the gradients first")
        self._stop, self._cancelled = threading.Event(), threading.Event()
        self._in_queues = [Queue() for _ in self.devices]
        self._out_queue = Queue()
        for j, device in enumerate(self.devices):
            thread = threading.Thread(target=_worker_loop, name=f"{THREAD_PREFIX}{j}", daemon=True,
                                      args=(device, self.num_threads, self._in_queues[j], self._out_queue,
                                            self._stop, self._cancelled))
            thread.start()
            self._threads.append(thread)

    def submit(self, task: Task) -> None:
        """Queue ``task`` on its stage's worker (tasks of one stage run in submission order)."""
        self._in_queues[task.stage].put(task)

    def report(self, task: Task) -> None:
        """Answer ``task`` as done, from inside a longer task (a rank's loop reports each action)."""
        self._out_queue.put((task, True, None))

    @property
    def cancelled(self) -> threading.Event:
        """Set once a task failed or :meth:`cancel` or :meth:`close` ran: the current call is stopping."""
        return self._cancelled

    def answer(self, timeout: float) -> Answer:
        """The next ``(task, ok, result | exc_info | None)`` from any worker (None: cancelled).

        Raises:
            queue.Empty: nothing arrived within ``timeout`` seconds.
        """
        return self._out_queue.get(timeout=timeout)

    def cancel(self) -> None:
        """Answer every task not yet started as cancelled, without running it."""
        self._cancelled.set()

    def close(self, timeout: float = 10.0) -> list[str]:
        """Cancel queued tasks, stop and join every worker; return the names still alive after ``timeout``.

        A worker finishes its current task first; one stuck inside a task cannot be
        killed, so it is reported and kept as a leftover (a daemon thread, it does not
        keep the interpreter alive).
        """
        self._cancelled.set()
        self._stop.set()
        for q in self._in_queues:
            q.put(None)
        # leftovers until joined, so that an interrupt of the join itself loses track of none
        threads, self._threads, self._in_queues = self._threads, [], []
        self._leftovers += threads
        for thread in threads:
            thread.join(timeout)
        self._leftovers = [t for t in self._leftovers if t.is_alive()]
        return [t.name for t in threads if t.is_alive()]
