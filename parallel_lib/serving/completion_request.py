"""What a ``POST /v1/completions`` body may hold, checked field by field (the HTTP server's input).

Each refusal is a :class:`BadRequest` carrying the HTTP status (400, or 404 for a model not served)
and the field it names, so the server answers ``{"error": {"message", "type", "param"}}`` without
knowing the rules; the accepted body becomes the engine's :class:`~parallel_lib.inference.batch.Request`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from parallel_lib.inference.batch import Request

__all__ = ["FIELDS", "BadRequest", "parse_completion"]

FIELDS = ("model", "prompt", "max_tokens", "temperature", "seed", "stream")


class BadRequest(ValueError):
    """A request the server refuses: its HTTP status, the field at fault (None: the whole body) and why."""

    def __init__(self, status: int, param: Optional[str], message: str) -> None:
        super().__init__(message)
        self.status, self.param, self.message = status, param, message

    def body(self) -> dict[str, Any]:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def _int(body: dict[str, Any], name: str, default: int, minimum: int, maximum: Optional[int] = None) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(400, name, f"{name} must be an integer, got {json.dumps(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        upto = f" and at most {maximum}" if maximum is not None else ""
        raise BadRequest(400, name, f"{name} must be at least {minimum}{upto}, got {value}")
    return value


def parse_completion(body: Any, model: str, vocab_size: int, n_positions: int, max_tokens: int,
                     tokenizer: Any = None) -> tuple[Request, bool]:
    """The engine's :class:`Request` and the ``stream`` flag of a ``/v1/completions`` body (see the module docstring).

    Args:
        body: the decoded JSON body.
        model: the served model's name.
        vocab_size, n_positions: the model's vocabulary and context.
        max_tokens: the server's limit on ``max_tokens``.
        tokenizer: turns a string prompt into ids (``encode(text)``, giving a list or an object with
            ``.ids``); None: only token ids are taken.

    Raises:
        BadRequest: 404 for another model, 400 for anything else wrong, naming the field.
    """
    if not isinstance(body, dict):
        raise BadRequest(400, None, f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadRequest(400, unknown[0], f"unknown field(s) {', '.join(unknown)}; this server reads "
                                          f"{', '.join(FIELDS)}")
    name = body.get("model")
    if not isinstance(name, str):
        raise BadRequest(400, "model", f"model must be a string (this server serves {model!r}), "
                                       f"got {json.dumps(name)}")
    if name != model:
        raise BadRequest(404, "model", f"model {name!r} is not served here; this server serves {model!r}")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest(400, "prompt", "this server has no tokenizer: send the prompt as a list of token ids")
        encoded = tokenizer.encode(prompt)
        prompt = list(getattr(encoded, "ids", encoded))
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BadRequest(400, "prompt", "prompt must be a string or a list of integer token ids (one prompt per "
                                        f"request), got {json.dumps(prompt)[:80]}")
    if not prompt:
        raise BadRequest(400, "prompt", "prompt is empty; send at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(400, "prompt", f"prompt token id(s) {bad[:4]} are outside the vocabulary 0..{vocab_size - 1}")
    if len(prompt) >= n_positions:
        raise BadRequest(400, "prompt", f"prompt has {len(prompt)} tokens; the model's context holds {n_positions}, "
                                        "leaving no room for a generated token")
    new = _int(body, "max_tokens", min(16, max_tokens), 1, max_tokens)
    if len(prompt) + new > n_positions:
        raise BadRequest(400, "max_tokens", f"max_tokens={new} after a prompt of {len(prompt)} tokens exceeds the "
                                            f"model's context of {n_positions}; ask for at most "
                                            f"{n_positions - len(prompt)}")
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 0.0
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0
            or not math.isfinite(temperature)):
        raise BadRequest(400, "temperature", f"temperature must be a number >= 0 (0: greedy), got "
                                             f"{json.dumps(temperature)}")
    seed = _int(body, "seed", 0, 0, 2**63 - 1)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(400, "stream", f"stream must be true or false, got {json.dumps(stream)}")
    return Request(prompt, new, temperature=float(temperature), seed=seed), bool(stream)
