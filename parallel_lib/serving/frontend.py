"""The front end: many client threads, one engine thread, a queue of updates per request between them.

The :class:`~parallel_lib.serving.engine.ServingEngine` is single-threaded: one step at a time, and
nothing may change its queues while a step runs. An HTTP server (:mod:`.http`) has a thread per
connection. :class:`Frontend` joins them the way vLLM's ``AsyncLLMEngine`` does, with one lock
instead of an event loop::

    client thread                         engine thread (the only one that steps)
    submit(request) --lock--> engine.add   loop: take the lock, engine.step(), publish, release
    ticket.next(timeout) <-- updates ----  publish: each request's new tokens onto its ticket's queue
    abort(ticket) --> abort list --------> between steps: engine.abort (blocks freed)

A request added while others run joins the batch at the next step (continuous batching). Every
accepted request ends with exactly one final :class:`Update`: its last tokens (``done``), or an
error: aborted by its client, the engine failed, or the front end closed. None is lost.

Every wait has a timeout: the lock (``lock_timeout``), the engine thread's sleep when idle
(``poll``), and :meth:`Frontend.close`'s join, which raises if the thread is still alive.

A ``threading.Lock`` is not fair: the engine thread releases it after a step and takes it again at
once, so a client waiting for it could wait until the engine runs dry. Clients therefore say that
they wait (``_waiting``), and the engine thread lets them in before its next step.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.inference.batch import Request
from parallel_lib.serving.engine import ServingEngine

__all__ = ["Update", "Ticket", "Frontend", "FrontendBusy", "FrontendClosed"]


class FrontendClosed(RuntimeError):
    """The front end is closed (or its engine failed): no new request is accepted."""


class FrontendBusy(RuntimeError):
    """Too many requests in flight, or the engine lock was not free in time: try again later."""


@dataclass
class Update:
    """What a request got since its last update.

    Attributes:
        tokens: its new tokens (possibly none).
        done: this is its last update.
        error: why it ended without finishing (``done`` is then True); None when it finished.
        finish_reason: ``"stop"`` (its ``eos``) or ``"length"`` (``max_new_tokens``) when it finished.
    """

    tokens: list[int] = field(default_factory=list)
    done: bool = False
    error: Optional[str] = None
    finish_reason: Optional[str] = None


class Ticket:
    """A submitted request: its id in the engine and the queue of its updates (read with :meth:`next`)."""

    def __init__(self, id: int, request: Request) -> None:
        self.id = id
        self.request = request
        self.sent = 0           # tokens already published (engine thread only)
        self.ended = False      # its final update is queued
        self._updates: queue.Queue[Update] = queue.Queue()

    def next(self, timeout: float) -> Optional[Update]:
        """The next update, or None if none came within ``timeout`` seconds."""
        try:
            return self._updates.get(timeout=timeout)
        except queue.Empty:
            return None

    def _put(self, update: Update) -> None:
        if not self.ended:
            self.ended = update.done
            self._updates.put(update)


class Frontend:
    """One engine thread stepping a :class:`ServingEngine`, fed by any number of client threads.

    Use as a context manager (or :meth:`start` / :meth:`close`)::

        with Frontend(engine) as front:
            ticket = front.submit(Request([1, 2, 3], 8))
            tokens, update = [], None
            while update is None or not update.done:
                update = ticket.next(timeout=1.0)
                tokens += update.tokens if update else []

    Args:
        engine: the engine; only the front end's thread touches it while the front end runs.
        max_pending: requests in flight at most (more are refused with :class:`FrontendBusy`).
        lock_timeout: seconds a client waits for the engine lock (one step) before :class:`FrontendBusy`.
        poll: seconds the engine thread sleeps when it has nothing to do before looking again.

    Raises:
        TypeError: ``engine`` is not a ServingEngine.
        ValueError: a count below 1 or a time not above 0.
    """

    def __init__(self, engine: ServingEngine, max_pending: int = 256, lock_timeout: float = 30.0,
                 poll: float = 0.05) -> None:
        if not isinstance(engine, ServingEngine):
            raise TypeError(f"engine must be a ServingEngine, got {type(engine).__name__}")
        self.engine = engine
        self.max_pending = positive_int("max_pending", max_pending)
        self.lock_timeout = positive_number("lock_timeout", lock_timeout)
        self.poll = positive_number("poll", poll)
        self.completed = 0      # requests that finished
        self.aborted = 0        # requests stopped by their client (abort)
        self.failed = 0         # requests ended by an engine failure or by close
        self.error: Optional[BaseException] = None  # what stopped the engine thread, if it failed
        self._lock = threading.Lock()
        self._waiting = 0       # client threads waiting for the lock (the engine lets them in first)
        self._count = threading.Lock()  # guards _waiting
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[int, Ticket] = {}
        self._aborts: deque[Ticket] = deque()
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # --- life -----------------------------------------------------------------------------------
    def start(self) -> "Frontend":
        """Start the engine thread (once).

        Raises:
            FrontendClosed: already closed.
        """
        if self._closed:
            raise FrontendClosed("this front end is closed; build a new one")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="serving-engine", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> "Frontend":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; every request still in flight gets its error update (and its blocks back).

        Raises:
            RuntimeError: the engine thread did not stop within ``timeout`` seconds (a step that hangs).
        """
        self._closed = True
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        if self._lock.acquire(timeout=timeout):
            try:
                self._end_all("the server shut down before this request finished")
            finally:
                self._lock.release()
        if thread is not None and thread.is_alive():
            raise RuntimeError(f"the engine thread did not stop within {timeout} s (a step that never returns)")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def live(self) -> int:
        """Requests accepted and not yet ended."""
        return len(self._live)

    # --- client side ----------------------------------------------------------------------------
    def submit(self, request: Request) -> Ticket:
        """Queue ``request`` for the engine; read its updates from the returned ticket.

        Raises:
            TypeError, ValueError: the engine refuses the request (:meth:`ServingEngine.add`'s checks, and a
                prompt token outside the vocabulary).
            FrontendClosed: closed, not started, or the engine failed.
            FrontendBusy: ``max_pending`` requests in flight, or the lock was not free within ``lock_timeout``.
        """
        if self._closed or not self.running:
            raise FrontendClosed("the server is not running" + (f": the engine failed ({self.error!r})"
                                                               if self.error else ""))
        if not self._client_acquire():
            raise FrontendBusy(f"the engine did not take a new request within {self.lock_timeout} s; try again")
        try:
            if self._closed or self.error is not None:
                raise FrontendClosed("the server is shutting down")
            if len(self._live) >= self.max_pending:
                raise FrontendBusy(f"{len(self._live)} requests in flight, max_pending={self.max_pending}; "
                                   "try again later")
            ticket = Ticket(next(self._ids), request)
            self.engine.add(request, index=ticket.id)
            result = self.engine.results[ticket.id]
            if result.error is not None:  # refused when added (a prompt token outside the vocabulary)
                del self.engine.results[ticket.id]
                raise ValueError(result.error)
            self._live[ticket.id] = ticket
        finally:
            self._lock.release()
        self._wake.set()
        return ticket

    @contextmanager
    def paused(self) -> Iterator[ServingEngine]:
        """Hold the engine between two steps and yield it (read its pool, its records); nothing runs meanwhile.

        Raises:
            FrontendBusy: the engine lock was not free within ``lock_timeout``.
        """
        if not self._client_acquire():
            raise FrontendBusy(f"the engine did not pause within {self.lock_timeout} s")
        try:
            yield self.engine
        finally:
            self._lock.release()

    def _client_acquire(self) -> bool:
        """Take the engine lock for a client thread within ``lock_timeout``, ahead of the engine's next step."""
        with self._count:
            self._waiting += 1
        try:
            return self._lock.acquire(timeout=self.lock_timeout)
        finally:
            with self._count:
                self._waiting -= 1

    def _let_clients_in(self) -> None:
        """Engine thread, lock released: wait (at most ``lock_timeout``) until the waiting clients have taken it."""
        deadline = time.monotonic() + self.lock_timeout
        while self._waiting and not self._stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)

    def abort(self, ticket: Ticket) -> None:
        """Stop ``ticket``'s request at the next step boundary (its blocks are freed); its last update says so."""
        self._aborts.append(ticket)
        self._wake.set()

    # --- engine side ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._lock.acquire(timeout=self.poll):
                    continue  # a client holds it (submit, paused): look at the stop flag, then try again
                try:
                    self._take_aborts()
                    busy = not self.engine.idle()
                    if busy:
                        record = self.engine.step()
                        if record is not None:
                            self._publish(record.tables, record.finished)
                finally:
                    self._lock.release()
                self._let_clients_in()
                if not busy:
                    self._wake.wait(self.poll)
                    self._wake.clear()
        except BaseException as error:  # noqa: BLE001 -- every client must hear of it, then the thread ends
            self.error = error
            if self._lock.acquire(timeout=self.lock_timeout):
                try:
                    self._end_all(f"the engine failed: {error!r}")
                finally:
                    self._lock.release()

    def _take_aborts(self) -> None:
        while self._aborts:
            ticket = self._aborts.popleft()
            if self._live.pop(ticket.id, None) is None:
                continue  # already ended
            self.engine.abort(ticket.id, "aborted by its client")
            self.engine.results.pop(ticket.id, None)
            self.aborted += 1
            ticket._put(Update(done=True, error="aborted by its client"))

    def _publish(self, ran: dict[int, list[int]], finished: list[int]) -> None:
        """Put the new tokens of every request that ran on its ticket; end the finished ones."""
        for id in ran:
            ticket = self._live.get(id)
            if ticket is None:
                continue
            result = self.engine.results[id]
            new = result.tokens[ticket.sent:]
            ticket.sent += len(new)
            if id not in finished:
                if new:
                    ticket._put(Update(new))
                continue
            del self._live[id]
            del self.engine.results[id]
            if result.error is not None:
                self.failed += 1
                ticket._put(Update(new, done=True, error=result.error))
            else:
                self.completed += 1
                eos = ticket.request.eos
                reason = "stop" if eos is not None and result.tokens and result.tokens[-1] == eos else "length"
                ticket._put(Update(new, done=True, finish_reason=reason))

    def _end_all(self, why: str) -> None:
        """Every live request ends with ``why`` (its blocks freed); the lock is held."""
        self._take_aborts()
        for id, ticket in list(self._live.items()):
            try:
                self.engine.abort(id, why)
            except Exception:  # noqa: BLE001 -- an engine that failed mid-step; its client must still hear
                pass
            self.engine.results.pop(id, None)
            self.failed += 1
            ticket._put(Update(done=True, error=why))
        self._live.clear()
