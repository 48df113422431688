"""A local HTTP endpoint in OpenAI's shape, ``POST /v1/completions``, in front of the serving engine.

Standard library only: ``http.server``'s threaded server, a thread per connection, and one engine
thread (:class:`~parallel_lib.serving.frontend.Frontend`) that runs the steps. A request that arrives
while others run joins the batch at the next step (continuous batching), as in vLLM's
OpenAI-compatible server. What a request may hold:

============  ========================================================================================
field         meaning here
============  ========================================================================================
model         required; the served model's name (``GET /v1/models``); another name gets 404
prompt        required; a non-empty list of token ids, or a string when the server has a tokenizer
max_tokens    tokens to generate, 1 up to the server's limit and the model's context (default 16)
temperature   0 (the default here; OpenAI's is 1): greedy, the tokens of Hugging Face's ``generate``;
              above 0: sampled from the request's own seeded stream
seed          that stream's seed (default 0)
stream        true: server-sent events, one ``data: {...}`` chunk per step's new tokens, then
              ``data: [DONE]``; false (default): one JSON answer when the request is done
============  ========================================================================================

Any other field (``n``, ``stop``, ``logprobs``, ``top_p`` ...), a wrong type, malformed JSON, an
empty prompt or too many tokens gets a 4xx and ``{"error": {"message", "type", "param"}}`` naming
the field (the rules: :mod:`.completion_request`). Each choice carries ``token_ids`` beside ``text`` (empty without a tokenizer).

Every accepted request ends: its tokens, or an error (in the stream, an ``error`` chunk before
``[DONE]``). A client that disconnects (found by polling its socket while the request runs, or by a
failed write) has its request aborted and its KV blocks freed. The server listens on 127.0.0.1
unless ``host`` says otherwise, and :class:`CompletionServer` is a context manager that leaves no
thread and no socket behind; every wait has a timeout.

Run it: ``python -m parallel_lib.serving.http --port 8000`` (a tiny random GPT-2; token ids in,
token ids out), then ``curl -N localhost:8000/v1/completions -d '{"model": "tiny", "prompt": [1, 2],
"max_tokens": 8, "stream": true}'``. Drive it with :mod:`.load`.
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Sequence

import torch

from parallel_lib.common.checks import positive_int, positive_number
from parallel_lib.inference.strategies import ServeConfig
from parallel_lib.serving.completion_request import FIELDS, BadRequest, parse_completion
from parallel_lib.serving.engine import ServingEngine
from parallel_lib.serving.frontend import Frontend, FrontendBusy, FrontendClosed, Ticket, Update

__all__ = ["FIELDS", "BadRequest", "parse_completion", "CompletionServer", "main"]


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _gone(sock: socket.socket) -> bool:
    """Whether the client closed its end (readable with nothing to read, or reset)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class _Handler(BaseHTTPRequestHandler):
    """One connection: one request (HTTP/1.0 semantics, closed after the answer)."""

    server: "_Server"
    server_version = "parallel_lib-serving/1"

    def setup(self) -> None:
        self.timeout = self.server.app.io_timeout  # reads and writes of a stalled client give up
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.app.log:
            super().log_message(format, *args)

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, error: BadRequest) -> None:
        self._json(error.status, error.body())

    def do_GET(self) -> None:
        app = self.server.app
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": app.model, "object": "model", "owned_by": "local"}]})
        elif self.path == "/health":
            self._json(200, {"ok": app.frontend.running, "live": app.frontend.live(),
                             "connections": app.connections()})
        else:
            self._error(BadRequest(404, None, f"no GET route {self.path}; try POST /v1/completions or GET /v1/models"))

    def do_POST(self) -> None:
        app = self.server.app
        try:
            if self.path != "/v1/completions":
                raise BadRequest(404, None, f"no POST route {self.path}; this server answers /v1/completions")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise BadRequest(411, None, "the request needs a Content-Length header")
            if int(length) > app.max_body:
                raise BadRequest(413, None, f"the body has {length} bytes, more than the limit of {app.max_body}")
            raw = self.rfile.read(int(length))
            try:
                body = json.loads(raw, parse_constant=_no_constant)
            except (UnicodeDecodeError, ValueError) as error:
                raise BadRequest(400, None, f"the body is not valid JSON: {error}") from None
            request, stream = parse_completion(body, app.model, app.engine.vocab_size, app.engine.n_positions,
                                               app.max_tokens, app.tokenizer)
            try:
                ticket = app.frontend.submit(request)
            except (FrontendBusy, FrontendClosed) as error:
                raise BadRequest(503, None, str(error)) from None
            except (TypeError, ValueError) as error:  # the engine's own refusal (a pool too small for it)
                raise BadRequest(400, "max_tokens", str(error)) from None
        except BadRequest as error:
            self._error(error)
            return
        except Exception as error:  # noqa: BLE001 -- a bug here must still answer its client
            self._error(BadRequest(500, None, f"internal error: {error!r}"))
            return
        self._answer(ticket, stream)

    def _updates(self, ticket: Ticket):
        """The ticket's updates until its last; aborts it if the client leaves or the deadline passes."""
        app = self.server.app
        deadline = time.monotonic() + app.request_timeout
        while True:
            update = ticket.next(app.poll)
            if update is not None:
                yield update
                if update.done:
                    return
            elif _gone(self.connection):
                app.frontend.abort(ticket)
                raise ConnectionAbortedError("the client disconnected")
            elif time.monotonic() > deadline:
                app.frontend.abort(ticket)
                yield Update(done=True, error=f"the request took longer than request_timeout={app.request_timeout} s")
                return

    def _choice(self, tokens: list[int], before: list[int], update: Update) -> dict[str, Any]:
        tokenizer = self.server.app.tokenizer
        text = tokenizer.decode(before + tokens)[len(tokenizer.decode(before)):] if tokenizer and tokens else ""
        return {"index": 0, "text": text, "token_ids": tokens, "logprobs": None,
                "finish_reason": update.finish_reason if update.done else None}

    def _answer(self, ticket: Ticket, stream: bool) -> None:
        app = self.server.app
        head = {"id": f"cmpl-{ticket.id}", "object": "text_completion", "created": int(time.time()),
                "model": app.model}
        try:
            if not stream:
                tokens: list[int] = []
                for update in self._updates(ticket):
                    tokens += update.tokens
                if update.error is not None:  # 503: the server shut down or its engine failed
                    self._error(BadRequest(500 if app.frontend.running else 503, None, update.error))
                    return
                self._json(200, {**head, "choices": [self._choice(tokens, [], update)],
                                 "usage": {"prompt_tokens": len(ticket.request.prompt),
                                           "completion_tokens": len(tokens),
                                           "total_tokens": len(ticket.request.prompt) + len(tokens)}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            sent: list[int] = []
            for update in self._updates(ticket):
                if update.tokens or (update.done and update.error is None):
                    chunk = {**head, "choices": [self._choice(update.tokens, sent, update)]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    sent += update.tokens
                if update.error is not None:
                    error = BadRequest(500, None, update.error).body()
                    self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        except (ConnectionError, TimeoutError, OSError):
            pass  # a failed write: the client is gone
        finally:
            app.frontend.abort(ticket)  # whatever ended the answer, the request ends too (an ended ticket ignores it)


class _Server(ThreadingHTTPServer):
    """The threaded server with a bounded, tracked set of connection threads (joined with a timeout on close)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # the listen backlog: socketserver's 5 resets connections when many clients start at once

    def __init__(self, address: tuple[str, int], app: "CompletionServer") -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.app = app
        self.connections: dict[threading.Thread, socket.socket] = {}
        self.guard = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.guard:
            full = len(self.connections) >= self.app.max_connections
            if not full:
                thread = threading.Thread(target=self._serve, args=(request, client_address), daemon=True,
                                          name=f"serving-http-{client_address[1]}")
                self.connections[thread] = request
        if full:  # answer at once rather than queue a thread
            try:
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n\r\n"
                                b'{"error": {"message": "too many connections", "type": "server_busy"}}')
            except OSError:
                pass
            self.shutdown_request(request)
            return
        thread.start()

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 -- a client's broken connection ends its thread, not the server
            if self.app.log:
                self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self.guard:
                self.connections.pop(threading.current_thread(), None)


class CompletionServer:
    """``POST /v1/completions`` over a :class:`ServingEngine`; see the module docstring.

    Use as a context manager (or :meth:`start` / :meth:`close`)::

        with CompletionServer(engine, model="tiny") as server:
            server.url   # http://127.0.0.1:PORT

    Args:
        engine: the engine (its thread is the server's; use nothing else on it while the server runs).
        model: the name clients give as ``model``.
        host: the address to listen on (127.0.0.1: this machine only; "0.0.0.0" exposes it).
        port: the port (0: a free one, see :attr:`port`).
        tokenizer: for string prompts and ``text`` (``encode``/``decode``); None: token ids only.
        max_tokens: the largest ``max_tokens`` (default: the model's context).
        max_connections: connection threads at most; more are answered 503 at once.
        max_pending: requests in flight at most (:class:`Frontend`); more get 503.
        request_timeout: seconds a request may run before it is aborted with an error.
        io_timeout: seconds a socket read or write may block (a stalled client).
        poll: seconds between checks of a waiting client's socket.
        log: print a line per request (http.server's log) to stderr.
        keep_records: the engine keeps its last this many step records (a server runs for long, and each
            step adds one); None: the engine's own setting (``ServingEngine(keep_records=...)``).

    Raises:
        TypeError: ``engine`` is not a ServingEngine, or ``host``/``model`` not a string.
        ValueError: a bad count or time, or a port outside 0..65535.
    """

    def __init__(self, engine: ServingEngine, model: str = "tiny", host: str = "127.0.0.1", port: int = 0,
                 tokenizer: Any = None, max_tokens: Optional[int] = None, max_connections: int = 64,
                 max_pending: int = 256, request_timeout: float = 300.0, io_timeout: float = 30.0,
                 poll: float = 0.02, log: bool = False, keep_records: Optional[int] = 1024) -> None:
        for name, value in (("host", host), ("model", model)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{name} must be a non-empty string, got {value!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0: any free port), got port={port!r}")
        self.frontend = Frontend(engine, max_pending=max_pending, poll=0.05)
        if keep_records is not None:
            engine.keep_records = keep_records
        self.engine, self.model, self.host, self.tokenizer = engine, model, host, tokenizer
        self.max_tokens = positive_int("max_tokens", engine.n_positions if max_tokens is None else max_tokens)
        self.max_connections = positive_int("max_connections", max_connections)
        self.request_timeout = positive_number("request_timeout", request_timeout)
        self.io_timeout = positive_number("io_timeout", io_timeout)
        self.poll = positive_number("poll", poll)
        self.max_body = 1 << 20
        self.log = bool(log)
        self._port = port
        self._httpd: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        """The port it listens on (the chosen one when built with ``port=0``).

        Raises:
            RuntimeError: not started.
        """
        if self._httpd is None:
            raise RuntimeError("the server is not started; call start() or use it in a with block")
        return int(self._httpd.server_address[1])

    def connections(self) -> int:
        """Client connections open now (a thread each)."""
        if self._httpd is None:
            return 0
        with self._httpd.guard:
            return len(self._httpd.connections)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "CompletionServer":
        """Bind, start the engine thread and the accepting thread.

        Raises:
            RuntimeError: already started.
            OSError: the address cannot be bound.
        """
        if self._httpd is not None:
            raise RuntimeError("the server is already started")
        self.frontend.start()
        try:
            self._httpd = _Server((self.host, self._port), self)
            self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                            name="serving-http-accept", daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "CompletionServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, end every request in flight (its client gets an error), join every thread, close sockets.

        Raises:
            RuntimeError: a thread still runs after ``timeout`` seconds (named).
        """
        httpd, accept = self._httpd, self._thread
        if accept is not None and accept.is_alive():
            httpd.shutdown()  # returns once serve_forever's loop sees it (poll_interval)
            accept.join(timeout)
        self.frontend.close(timeout)  # every live request gets its error update: its handler answers and ends
        alive: list[threading.Thread] = []
        if httpd is not None:
            deadline = time.monotonic() + timeout
            with httpd.guard:
                threads = list(httpd.connections.items())
            for thread, sock in threads:
                thread.join(max(0.0, deadline - time.monotonic()) / 2)
                if thread.is_alive():  # a client that sends nothing: wake its read
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    thread.join(max(0.0, deadline - time.monotonic()))
            alive = [t for t, _ in threads if t.is_alive()]
            httpd.server_close()
        self._httpd, self._thread = None, None
        if accept is not None and accept.is_alive():
            alive.append(accept)
        if alive:
            raise RuntimeError(f"threads still running after close: {[t.name for t in alive]}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m parallel_lib.serving.http``: serve a tiny random GPT-2 until interrupted (Ctrl-C or SIGTERM)."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lib.serving.http", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    parser.add_argument("--model", default="tiny", help="GPT-2 size: tiny, small or gpt2 (random weights)")
    parser.add_argument("--vocab-size", type=int, default=97)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--max-connections", type=int, default=64)
    parser.add_argument("--quiet", action="store_true", help="no line per request")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = ServeConfig(model=args.model, vocab_size=args.vocab_size, seed=args.seed).build().to(args.device)
    engine = ServingEngine(model, args.num_blocks, args.block_size, args.max_batch)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())  # main() runs in the main thread
    try:
        with CompletionServer(engine, model=args.model, host=args.host, port=args.port,
                              max_connections=args.max_connections, log=not args.quiet) as server:
            print(f"serving {args.model} on {server.url}/v1/completions (Ctrl-C stops)", flush=True)
            while not stop.wait(0.5):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
