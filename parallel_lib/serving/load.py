"""A load generator that drives the HTTP endpoint (:mod:`.http`) the way clients do, on this machine only.

``clients`` threads (a bounded pool) each send streaming ``POST /v1/completions`` requests, one at
a time, over their own connection, and time what comes back on their own clock: the request sent
(``arrival``), then each chunk's tokens (``token_times``). The answers become chapter 09's
:class:`~parallel_lib.inference.batch.Result`, so :func:`~parallel_lib.serving.trace.trace_metrics`
reads them as it reads an engine's: throughput, time to first token (TTFT) and time per output
token (TPOT), p50 and p99, here measured as a client sees them (HTTP and JSON included).

Every request ends one of three ways, counted in :class:`LoadReport`: *completed* (its tokens and
``data: [DONE]``), *refused* (the server answered with an error: a 4xx/5xx or an error chunk), or
*lost* (no answer: a timeout, a connection cut, a stream without ``[DONE]``). The server's promise
is ``lost == 0``.

Only loopback addresses are driven: this is a bench for one's own server, not a tool to aim at others.

``python -m parallel_lib.serving.load [--url http://127.0.0.1:PORT] [--clients 32] [--requests 128]``
(without ``--url`` it starts a server with a tiny GPT-2 in its own process for the run, :func:`served`).
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence
from urllib.parse import urlsplit

from parallel_lib.common.checks import check_int, positive_int, positive_number
from parallel_lib.common.tables import markdown_table
from parallel_lib.inference.batch import Result
from parallel_lib.runtime.environment import machine_label
from parallel_lib.serving.goodput import goodput
from parallel_lib.serving.trace import TraceMetrics, trace_metrics

__all__ = ["completion_bodies", "send_completion", "LoadReport", "run_load", "markdown", "served", "main"]

MAX_CLIENTS = 256


def completion_bodies(n: int, model: str = "tiny", vocab_size: int = 97, prompt_lengths: tuple[int, int] = (2, 48),
                      max_tokens: tuple[int, int] = (4, 48), seed: int = 0, stream: bool = True) -> list[dict]:
    """``n`` seeded ``/v1/completions`` bodies: random token-id prompts and ``max_tokens``, each length uniform
    in its inclusive range; greedy.

    Raises:
        ValueError: ``n`` or a length below 1, or a range whose low end exceeds its high end.
    """
    positive_int("n", n)
    for name, (low, high) in (("prompt_lengths", prompt_lengths), ("max_tokens", max_tokens)):
        check_int(f"{name}[1]", high, minimum=positive_int(f"{name}[0]", low))
    rng = random.Random(seed)
    return [{"model": model, "prompt": [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lengths))],
             "max_tokens": rng.randint(*max_tokens), "temperature": 0, "stream": stream} for _ in range(n)]


def _loopback(host: str) -> str:
    """``host`` if it names this machine's loopback interface.

    Raises:
        ValueError: any other address.
    """
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host) if host == "localhost" else host)
    except ValueError:
        address = None
    if address is None or not address.is_loopback:
        raise ValueError(f"host must be a loopback address (127.0.0.1, ::1, localhost), got host={host!r}: the "
                         "load generator drives a server on this machine only")
    return host


def send_completion(host: str, port: int, body: dict, index: int = 0, timeout: float = 60.0) -> tuple[Result, str]:
    """Send one completion request and read its answer (streamed or not) as a client does.

    Returns:
        its :class:`Result` (``arrival`` and ``token_times`` on ``time.perf_counter``; ``error`` set when the
        server refused it or nothing came back) and how it ended: ``"completed"``, ``"refused"`` or ``"lost"``.
    """
    result = Result(index, arrival=time.perf_counter())
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            result.error = f"{response.status}: {response.read().decode(errors='replace')}"
            return result, "refused"
        if not body.get("stream"):
            answer = json.loads(response.read())
            result.tokens = list(answer["choices"][0]["token_ids"])
            result.token_times = [time.perf_counter()] * len(result.tokens)
            return result, "completed"
        while True:
            line = response.readline()
            if not line:
                result.error = "the stream ended without data: [DONE]"
                return result, "lost"
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return (result, "refused") if result.error else (result, "completed")
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                continue
            now = time.perf_counter()
            tokens = chunk["choices"][0]["token_ids"]
            result.tokens += tokens
            result.token_times += [now] * len(tokens)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
        result.error = f"no answer: {error!r}"
        return result, "lost"
    finally:
        conn.close()


@dataclass
class LoadReport:
    """What a load run got.

    Attributes:
        clients: concurrent clients.
        requests: requests sent.
        completed, refused, lost: how they ended (see the module docstring).
        seconds: wall time from the first request sent to the last answer.
        metrics: throughput (generated tokens per second), TTFT, TPOT and latency over the completed ones.
        results: every request's result, by index.
    """

    clients: int
    requests: int
    completed: int
    refused: int
    lost: int
    seconds: float
    metrics: Optional[TraceMetrics]
    results: list[Result]

    def goodput(self, ttft: float, tpot: float) -> float:
        """Completed requests per second that met the latency target (:func:`~parallel_lib.serving.goodput.goodput`:
        TTFT at most ``ttft``, TPOT at most ``tpot`` seconds); 0.0 when none completed."""
        done = [r for r in self.results if r.ok and r.token_times]
        return goodput(done, ttft, tpot).per_second if done else 0.0


def run_load(host: str, port: int, bodies: Sequence[dict], clients: int = 32, timeout: float = 60.0) -> LoadReport:
    """Send ``bodies`` from ``clients`` concurrent clients (each one request at a time) and measure.

    Args:
        host, port: the server (loopback only).
        bodies: the requests' JSON bodies, sent in order as clients become free.
        clients: concurrent clients, 1 to 256 (a thread each).
        timeout: seconds one socket operation may block before the request counts as lost.

    Raises:
        ValueError: a host that is not loopback, no bodies, a bad count or time.
    """
    _loopback(host)
    check_int("port", port, minimum=1, maximum=65535)
    check_int("clients", clients, minimum=1, maximum=MAX_CLIENTS, hint="each client is a thread")
    positive_number("timeout", timeout)
    if len(bodies) == 0:
        raise ValueError("bodies must hold at least one request body")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="load-client") as pool:
        answers = list(pool.map(lambda ib: send_completion(host, port, ib[1], ib[0], timeout), enumerate(bodies)))
    seconds = time.perf_counter() - start
    results = [r for r, _ in answers]
    ends = [e for _, e in answers]
    done = [r for r, e in answers if e == "completed" and r.token_times]
    return LoadReport(clients, len(bodies), ends.count("completed"), ends.count("refused"), ends.count("lost"),
                      seconds, trace_metrics(done) if done else None, results)


def markdown(report: LoadReport, machine: str, slo: Optional[tuple[float, float]] = None) -> str:
    """The report as a one-row markdown table, with the machine.

    Args:
        report: what :func:`run_load` measured.
        machine: where it ran, in words.
        slo: a latency target ``(ttft, tpot)`` in seconds: adds the goodput, the completed requests per
            second that met it (:meth:`LoadReport.goodput`).
    """
    m = report.metrics
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    row = [report.clients, report.requests, report.completed, report.refused, report.lost]
    row += [f"{m.throughput:.0f}", ms(m.ttft_p50), ms(m.ttft_p99), ms(m.tpot_p50), ms(m.tpot_p99)] if m else ["-"] * 5
    header = ["clients", "requests", "completed", "refused", "lost", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
              "TPOT p50 ms", "TPOT p99 ms"]
    if slo is not None:
        header.append("goodput req/s")
        row.append(f"{report.goodput(*slo):.1f}")
    return markdown_table(header, [row]) + f"\n\nmachine: {machine}; wall time {report.seconds:.2f} s"


@contextmanager
def served(options: Sequence[str], timeout: float = 120.0) -> Iterator[int]:
    """Run ``python -m parallel_lib.serving.http --port 0 OPTIONS`` in its own process and yield its port.

    The server gets its own interpreter (its own GIL: the clients' threads do not slow its engine).
    On exit it is stopped with SIGTERM (then killed if it has not ended within 15 s).

    Raises:
        RuntimeError: it ended, or printed no address within ``timeout`` seconds (its output is quoted).
    """
    command = [sys.executable, "-m", "parallel_lib.serving.http", "--port", "0", "--quiet", *options]
    with tempfile.TemporaryFile("a+") as log:  # a file, not a pipe (a chatty server never blocks); appended to
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout
            while not (found := re.search(r"http://127\.0\.0\.1:(\d+)/", _read(log))):
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"the server did not start within {timeout} s: {' '.join(command)}\n"
                                       + _read(log)[-2000:])
                time.sleep(0.1)
            yield int(found.group(1))
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(15)


def _read(file) -> str:
    file.seek(0)
    return file.read()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m parallel_lib.serving.load``: drive a server (or one of its own) and print the table."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.serving.load", description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: start one in its own process for the run)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=97)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(2, 48))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(4, 48))
    parser.add_argument("--max-batch", type=int, default=32, help="the own server's engine batch")
    parser.add_argument("--num-blocks", type=int, default=512, help="the own server's KV pool")
    parser.add_argument("--device", default="cpu", help="the own server's device")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the own server")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bodies = completion_bodies(args.requests, args.model, args.vocab_size, tuple(args.prompt_lengths),
                               tuple(args.max_tokens), args.seed)
    if args.url:
        parts = urlsplit(args.url)
        report = run_load(parts.hostname or "", parts.port or 80, bodies, args.clients)
        print(markdown(report, "the server's machine (not measured here)"))
        return 0 if report.lost == 0 else 1
    options = ["--model", args.model, "--vocab-size", str(args.vocab_size), "--max-batch", str(args.max_batch),
               "--num-blocks", str(args.num_blocks), "--device", args.device, "--threads", str(args.threads),
               "--max-connections", str(max(64, 2 * args.clients))]
    with served(options) as port:
        report = run_load("127.0.0.1", port, bodies, args.clients)
    print(markdown(report, f"{machine_label()}; server in its own process: {args.model} GPT-2 on {args.device}, "
                           f"torch threads {args.threads}, max_batch {args.max_batch}"))
    return 0 if report.lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
