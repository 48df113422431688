"""Chapter 13's HTTP endpoint: OpenAI-shaped ``/v1/completions`` over the serving engine, driven as clients do.

Proofs: greedy tokens from the endpoint (streamed or not, concurrent requests batched together)
equal Hugging Face ``generate``; 32 concurrent clients lose no request; each kind of bad request
gets its 4xx naming the field; a client that disconnects has its request aborted and every block
back; the listener is on loopback only; closing the server (even by an exception in its ``with``)
ends every request in flight with an error and leaves no thread and no socket.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from _fault_workers import _LOOPBACK, _socket_inodes
from parallel_lib.inference import Request, ServeConfig
from parallel_lib.serving import ServingEngine
from parallel_lib.serving.frontend import Frontend
from parallel_lib.serving.http import BadRequest, CompletionServer, parse_completion
from parallel_lib.serving.load import completion_bodies, main as load_main, markdown, run_load, send_completion

CONFIG = ServeConfig(initializer_range=0.3)   # the tiny GPT-2 of the serving tests: vocabulary 97, context 128
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], list(range(20, 33))]
NEW = [7, 3, 9, 12, 6]


class Chars:
    """A character tokenizer for the test: printable ASCII, id = code - 32 (95 ids, in a vocabulary of 97)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 32) for i in ids)


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextmanager
def held_when(server, condition, timeout: float = 10.0):
    """Pause the engine at the first step boundary where ``condition(engine)`` holds, and yield it paused."""
    deadline = time.monotonic() + timeout
    while True:
        with server.frontend.paused() as engine:
            if condition(engine):
                yield engine
                return
        assert time.monotonic() < deadline, f"the engine never reached the state asked for in {timeout} s"
        time.sleep(0.002)


def serving_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("serving-", "load-client"))]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CONFIG.build()


@pytest.fixture(scope="module")
def server(model):
    engine = ServingEngine(model, num_blocks=160, block_size=4, max_batch=16)
    with CompletionServer(engine, model="tiny", tokenizer=Chars(), max_tokens=120, keep_records=16) as server:
        yield server
    assert serving_threads() == []


def post(server, body, raw: bytes | None = None, path: str = "/v1/completions") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=raw if raw is not None else json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def free_blocks(server) -> int:
    with server.frontend.paused() as engine:
        return engine.blocks.num_free()


# --- tokens --------------------------------------------------------------------------------------

def test_greedy_tokens_from_the_endpoint_equal_hugging_face_generate_streamed_or_not(server, model):
    expected = []
    for p, n in zip(PROMPTS, NEW):
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    assert len({t for tokens in expected for t in tokens}) > 5, "a model that repeats one token proves little"
    for stream in (True, False):  # all five at once: they share steps (continuous batching)
        bodies = [{"model": "tiny", "prompt": p, "max_tokens": n, "stream": stream} for p, n in zip(PROMPTS, NEW)]
        report = run_load("127.0.0.1", server.port, bodies, clients=len(bodies))
        assert [r.tokens for r in report.results] == expected
    status, answer = post(server, {"model": "tiny", "prompt": "Hi!", "max_tokens": 4})
    assert status == 200
    choice = answer["choices"][0]
    assert choice["text"] == Chars().decode(choice["token_ids"]) and choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert post(server, {"model": "tiny", "prompt": [40, 73, 1], "max_tokens": 4})[1]["choices"][0]["token_ids"] \
        == choice["token_ids"]  # "Hi!" is ids 40, 73, 1


def test_a_stream_is_server_sent_events_ending_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 5,
                                                             "stream": True}))
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = [e for e in response.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert {c["object"] for c in chunks} == {"text_completion"}


# --- load ----------------------------------------------------------------------------------------

def test_32_concurrent_clients_lose_no_request_and_every_block_comes_back(server):
    start = free_blocks(server)
    bodies = completion_bodies(64, prompt_lengths=(2, 24), max_tokens=(2, 24), seed=1)
    report = run_load("127.0.0.1", server.port, bodies, clients=32)
    assert (report.completed, report.refused, report.lost) == (64, 0, 0), [r.error for r in report.results if r.error][:3]
    assert [len(r.tokens) for r in report.results] == [b["max_tokens"] for b in bodies]
    assert report.metrics.throughput > 0 and report.metrics.ttft_p50 <= report.metrics.ttft_p99
    assert "| 32 | 64 | 64 | 0 | 0 |" in markdown(report, "this machine")
    assert wait_until(lambda: server.frontend.live() == 0) and free_blocks(server) == start
    with server.frontend.paused() as engine:  # a long-running server keeps its engine's newest 16 step records
        assert len(engine.records) == 16 < engine.steps
        assert [r.step for r in engine.records] == list(range(engine.steps - 16, engine.steps))
    with pytest.raises(ValueError, match="host must be a loopback address"):
        run_load("10.1.2.3", server.port, bodies)


def test_the_load_generator_drives_a_server_from_the_command_line(server, capsys):
    # (without --url it starts its own server in a process of its own: seconds of imports, left out of the tests)
    assert load_main(["--url", server.url, "--requests", "4", "--clients", "2", "--max-tokens", "2", "4"]) == 0
    assert "| 2 | 4 | 4 | 0 | 0 |" in capsys.readouterr().out


# --- bad requests --------------------------------------------------------------------------------

GOOD = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}


@pytest.mark.parametrize("body, raw, status, param, words", [
    (None, b"{not json", 400, None, "not valid JSON"),
    (None, b"[1, 2]", 400, None, "must be a JSON object"),
    (None, b'{"model": "tiny", "prompt": [1], "temperature": NaN}', 400, None, "not valid JSON"),
    ({**GOOD, "prompt": []}, None, 400, "prompt", "prompt is empty"),
    ({**GOOD, "prompt": ""}, None, 400, "prompt", "prompt is empty"),
    ({**GOOD, "prompt": [[1, 2], [3]]}, None, 400, "prompt", "one prompt per request"),
    ({**GOOD, "prompt": [1, 500]}, None, 400, "prompt", r"\[500\] are outside the vocabulary 0..96"),
    ({**GOOD, "max_tokens": 121}, None, 400, "max_tokens", "at most 120, got 121"),
    ({**GOOD, "prompt": list(range(90)), "max_tokens": 60}, None, 400, "max_tokens", "context of 128"),
    ({**GOOD, "max_tokens": 0}, None, 400, "max_tokens", "at least 1"),
    ({**GOOD, "max_tokens": "4"}, None, 400, "max_tokens", "must be an integer"),
    ({**GOOD, "temperature": "hot"}, None, 400, "temperature", "must be a number"),
    ({**GOOD, "temperature": -1}, None, 400, "temperature", ">= 0"),
    ({**GOOD, "stream": "yes"}, None, 400, "stream", "true or false"),
    ({**GOOD, "seed": 1.5}, None, 400, "seed", "must be an integer"),
    ({**GOOD, "model": 3}, None, 400, "model", "must be a string"),
    ({**GOOD, "n": 2, "top_p": 1}, None, 400, "n", "unknown field.* n, top_p"),
    ({"prompt": [1]}, None, 400, "model", "must be a string"),
    ({**GOOD, "model": "gpt-4"}, None, 404, "model", "'gpt-4' is not served here"),
])
def test_each_bad_request_gets_its_4xx_naming_the_field(server, body, raw, status, param, words):
    import re

    got, answer = post(server, body, raw)
    assert got == status
    assert answer["error"]["param"] == param and re.search(words, answer["error"]["message"])


def test_a_wrong_route_is_404_and_a_missing_length_411(server):
    assert post(server, GOOD, path="/v1/chat/completions")[0] == 404
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\n\r\n")
        assert sock.makefile("rb").readline().split()[1] == b"411"


def test_parse_completion_reads_every_field():
    request, stream = parse_completion({"model": "m", "prompt": [1, 2], "max_tokens": 3, "temperature": 0.5,
                                        "seed": 7, "stream": True}, "m", vocab_size=10, n_positions=8, max_tokens=5)
    assert (request.prompt, request.max_new_tokens, request.temperature, request.seed, stream) == \
        ((1, 2), 3, 0.5, 7, True)
    request, stream = parse_completion({"model": "m", "prompt": [1]}, "m", 10, 64, 100)
    assert (request.max_new_tokens, request.temperature, stream) == (16, 0.0, False)
    with pytest.raises(BadRequest, match="no tokenizer: send the prompt as a list of token ids"):
        parse_completion({"model": "m", "prompt": "hello"}, "m", 10, 64, 100)


def test_engine_abort_frees_a_running_or_a_waiting_request(model):
    engine = ServingEngine(model, num_blocks=8, block_size=4, max_batch=1)
    a, b = engine.add(Request([1, 2, 3], 10)), engine.add(Request([4, 5], 10))
    engine.step()  # a runs, b waits
    assert engine.blocks.num_free() == 7 and engine.scheduler.waiting
    assert engine.abort(b) and engine.abort(a, "gone") and not engine.abort(a)
    assert engine.blocks.num_free() == 8 and engine.idle() and engine.step() is None
    assert engine.results[a].error == f"request {a}: gone" and len(engine.results[a].tokens) == 1



def test_a_client_gets_the_engine_lock_at_the_next_step_boundary(model):
    """A Lock is not fair: without the hand-off the engine thread takes it back after every step, and
    a client asking for it (submit, paused) waits until the engine runs dry."""
    engine = ServingEngine(model, num_blocks=160, block_size=4, max_batch=16)
    with Frontend(engine) as front:
        tickets = [front.submit(Request([1 + i, 2, 3], 120)) for i in range(8)]
        waited = []
        for _ in range(5):
            before = len(engine.records)
            with front.paused():
                waited.append(len(engine.records) - before)
            time.sleep(0.001)
        assert max(waited) <= 2 and front.live() == 8, waited  # at most the step running when it asked
        for ticket in tickets:
            front.abort(ticket)

# --- disconnects, listeners, shutdown ------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(server, stream):
    start, aborted = free_blocks(server), server.frontend.aborted
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 120, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    # hold the engine at the first step boundary where the request holds blocks (admitted, mid-generation);
    # the client leaves and the handler sees it
    with held_when(server, lambda engine: server.frontend.live() == 1 and engine.blocks.num_free() < start):
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.0 200")  # it is running: its first token came
        sock.close()
        assert wait_until(lambda: server.connections() == 0)
    assert wait_until(lambda: server.frontend.live() == 0)
    assert server.frontend.aborted == aborted + 1 and free_blocks(server) == start


def test_the_listener_is_on_loopback_only(server):
    inodes = _socket_inodes(os.getpid())
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes:
                listening.append((address, int(port, 16)))
    assert ("0100007F", server.port) in listening
    assert [a for a, _ in listening if a not in _LOOPBACK] == []


def test_closing_mid_request_answers_every_client_and_leaves_no_thread_or_socket(model):
    engine = ServingEngine(model, num_blocks=64, block_size=4, max_batch=1)  # one at a time: the others wait
    before = set(threading.enumerate())
    outcomes: list[tuple[str, str]] = []
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 100, "stream": True}
    with pytest.raises(KeyboardInterrupt):  # an interrupted notebook cell
        with CompletionServer(engine) as server:
            port = server.port
            clients = [threading.Thread(target=lambda: outcomes.append(
                (lambda r: (r[1], r[0].error or ""))(send_completion("127.0.0.1", port, body, timeout=30))))
                for _ in range(3)]
            for c in clients:
                c.start()
            assert wait_until(lambda: server.frontend.live() == 3)
            raise KeyboardInterrupt
    for c in clients:
        c.join(10)
    assert [kind for kind, _ in outcomes].count("lost") == 0 and len(outcomes) == 3
    assert any(kind == "refused" and "shut down" in error for kind, error in outcomes)
    assert [t.name for t in threading.enumerate() if t not in before] == [] and engine.blocks.num_free() == 64
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_bad_arguments_are_refused(model):
    engine = ServingEngine(model, num_blocks=8, block_size=4)
    with pytest.raises(TypeError, match="host must be a non-empty string"):
        CompletionServer(engine, host=None)
    with pytest.raises(ValueError, match="port must be an int in 0..65535"):
        CompletionServer(engine, port=70000)
    with pytest.raises(TypeError, match="engine must be a ServingEngine"):
        Frontend(model)
    with pytest.raises(RuntimeError, match="not started"):
        CompletionServer(engine).port


def test_an_engine_that_fails_ends_every_request_with_its_error_and_refuses_new_ones(model):
    engine = ServingEngine(model, num_blocks=64, block_size=4, max_batch=4)
    step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) > 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return step()

    engine.step = failing_step
    with CompletionServer(engine) as server:
        body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 20, "stream": True}
        result, end = send_completion("127.0.0.1", server.port, body, timeout=10)
        assert end == "refused" and len(result.tokens) == 3 and "CUDA out of memory (simulated)" in result.error
        status, answer = post(server, GOOD)
        assert status == 503 and "the engine failed" in answer["error"]["message"]
    assert engine.blocks.num_free() == 64
