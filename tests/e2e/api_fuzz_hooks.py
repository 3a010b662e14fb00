"""Schemathesis hooks of tests/e2e/test_api_fuzz.py, loaded by its CLI (SCHEMATHESIS_HOOKS): the
check that every error is OpenAI-shaped, and the bounds that keep generation requests cheap.

Most model names become the served model (PAGODA_FUZZ_MODEL), so that requests get past the model
lookup; one in five (chosen by the name, so runs repeat) stays as generated. Valid but large amounts
of work (max_tokens, n, several prompts) are cut to a few tokens and sequences, and a deadline
(`timeout`) shorter than MIN_TIMEOUT_S is raised to it: a request that may not wait for the engine's
next step is dropped with 503 queue_timeout, as designed. Invalid values are left as they are, to be
refused. Generation bodies that do not say whether to stream are sent both ways, since the
generator seldom sets `stream` itself.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import schemathesis
from hypothesis import strategies as st

MAX_MODEL_LEN = 128
MAX_NEW_TOKENS = 4
MAX_SEQUENCES = 2
MIN_TIMEOUT_S = 30.0
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
MODEL_PATHS = (*GENERATION_PATHS, "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize")
# Anthropic's Messages API answers errors and streams in Anthropic's shapes.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# The Responses API streams typed events (its errors, before a stream, are OpenAI's).
RESPONSES_PATHS = ("/v1/responses",)
ERROR_FIELDS = {"message", "type", "param", "code"}
RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def _error_problem(body: Any) -> str | None:
    """Why `body` is not {"error": {"message": str, "type": str, "param": str | null, "code":
    str | null}}; None when it is."""
    error = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(error, dict) and set(error) == ERROR_FIELDS and set(body) == {"error"}):
        return "not an OpenAI error"
    for name in ("message", "type"):
        if not (isinstance(error[name], str) and error[name]):
            return f"error.{name} is not a non-empty string"
    for name in ("param", "code"):
        if not (error[name] is None or isinstance(error[name], str)):
            return f"error.{name} is neither a string nor null"
    return None


def _stream_problem(text: str) -> str | None:
    """Why a server-sent event stream is not chunks (errors in OpenAI's shape among them) ending
    with [DONE]; None when it is."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "the stream does not end with data: [DONE]"
    for event in events[:-1]:
        body = json.loads(event)
        if "error" in body and (problem := _error_problem(body)):
            return f"{problem}: {event[:300]}"
    return None


def _anthropic_error_problem(body: Any) -> str | None:
    """Why `body` is not {"type": "error", "error": {"type": str, "message": str}}."""
    error = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(error, dict) and body.get("type") == "error" and set(body) == {"type", "error"}):
        return "not an Anthropic error"
    if not all(isinstance(error.get(name), str) and error[name] for name in ("type", "message")):
        return "error.type or error.message is not a non-empty string"
    return None


def _anthropic_stream_problem(text: str) -> str | None:
    """Why Anthropic's events are not message_start ... message_stop (or an error event last)."""
    events = [block.split("\n", 1) for block in text.split("\n\n") if block.startswith("event: ")]
    names = [head.removeprefix("event: ") for head, _ in events]
    if not names or names[0] != "message_start" and names[0] != "error":
        return f"the stream does not begin with message_start: {names[:3]}"
    if names[-1] == "error":
        body = json.loads(events[-1][1].removeprefix("data: "))
        return _anthropic_error_problem(body)
    if names[-1] != "message_stop":
        return f"the stream does not end with message_stop: {names[-3:]}"
    return None


def _responses_stream_problem(text: str) -> str | None:
    """Why the Responses events are not response.created ... a terminal event, numbered from 0, each
    naming its own type (an error event with its message before response.failed)."""
    events = [block.split("\n", 1) for block in text.split("\n\n") if block.startswith("event: ")]
    bodies = [json.loads(data.removeprefix("data: ")) for _, data in events]
    names = [head.removeprefix("event: ") for head, _ in events]
    if not names or names[0] != "response.created" or names[-1] not in RESPONSE_ENDS:
        return f"the stream is not response.created ... a terminal event: {names[:2]} ... {names[-2:]}"
    if [b.get("type") for b in bodies] != names:
        return "an event's type is not its name"
    if [b.get("sequence_number") for b in bodies] != list(range(len(bodies))):
        return "the sequence numbers do not count from 0"
    for body in bodies:
        if body["type"] == "error" and not (isinstance(body.get("message"), str) and body["message"]):
            return f"an error event has no message: {body!r:.300}"
    return None


@schemathesis.check
def openai_shaped_errors(ctx, response, case) -> bool | None:
    """Every 4xx and 5xx answers an OpenAI error, and so does every error event of a stream;
    Anthropic's shapes on the Messages API."""
    content_type = response.headers.get("content-type", [""])[0]
    anthropic = case.operation.path in ANTHROPIC_PATHS
    if response.status_code < 400 and content_type.startswith("text/event-stream"):
        if case.operation.path in RESPONSES_PATHS:
            problem = _responses_stream_problem(response.text)
        else:
            problem = (_anthropic_stream_problem if anthropic else _stream_problem)(response.text)
        if problem:
            raise AssertionError(f"The event stream is malformed: {problem}")
        return True
    if response.status_code < 400:
        return None
    try:
        body = response.json()
    except ValueError as exc:
        raise AssertionError(
            f"The {response.status_code} answer is not JSON: {response.text[:300]!r}"
        ) from exc
    problem = (_anthropic_error_problem if anthropic else _error_problem)(body)
    if problem:
        raise AssertionError(f"The {response.status_code} answer is {problem}: {body!r:.300}")
    return True


def _cut(value: Any, bound: int, ceiling: int) -> Any:
    """`value` cut to `bound` when it is a valid integer above it (up to `ceiling`); JSON's 3.0
    is an integer too."""
    is_int = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
    return bound if is_int and bound < value <= ceiling else value


def bounded(body: dict[str, Any], path: str) -> dict[str, Any]:
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"):
        if field in body:
            body[field] = _cut(body[field], MAX_NEW_TOKENS, MAX_MODEL_LEN)
    if path in RESPONSES_PATHS:
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_NEW_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW_TOKENS
    for field in ("n", "best_of"):
        if field in body:
            body[field] = _cut(body[field], MAX_SEQUENCES, 128)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:MAX_SEQUENCES]
    timeout = body.get("timeout")
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < MIN_TIMEOUT_S:
        body["timeout"] = MIN_TIMEOUT_S
    return body


@schemathesis.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy:
    operation = context.operation
    if not isinstance(body, dict) or operation is None:
        return st.just(body)
    model = body.get("model")
    if operation.path in MODEL_PATHS and isinstance(model, str) and zlib.crc32(model.encode()) % 5:
        body["model"] = os.environ["PAGODA_FUZZ_MODEL"]
    if operation.path not in GENERATION_PATHS:
        return st.just(body)
    body = bounded(body, operation.path)
    if "stream" in body:
        return st.just(body)
    return st.sampled_from([body, {**body, "stream": True}])
