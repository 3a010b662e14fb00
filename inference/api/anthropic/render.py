"""A Messages answer, from the one generation's events: the whole message of a finished choice,
or the stream of Anthropic's events (message_start, content blocks with their text and tool input
JSON deltas, message_delta with the stop reason and usage, message_stop); errors in Anthropic's
shape, with its status codes."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from django.http import JsonResponse, StreamingHttpResponse

from core.api.exceptions import platform_error_of
from core.errors import PlatformError
from inference.api.chat_completions.messages import ChoiceMessageStream, chat_message
from inference.services import ChoiceDelta, ChoiceFinished, Generation, GenerationPlan, GenerationUsage
from inference.services.generation import CollectedChoice

logger = logging.getLogger(__name__)

# Anthropic's error types by status; 503 (no engine, a dependency down) is its 529 overloaded.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _status(error: PlatformError) -> int:
    return 529 if error.status_code == 503 else error.status_code


def error_body(error: PlatformError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(_status(error), "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(exc: Exception) -> JsonResponse:
    """`exc` in Anthropic's error shape, with its status and headers (retry-after on a 429)."""
    error = platform_error_of(exc)
    response = JsonResponse(error_body(error), status=_status(error))
    for name, value in error.headers.items():
        response[name] = value
    return response


def message_id(plan: GenerationPlan) -> str:
    return f"msg_{plan.request_id}"


def usage_body(usage: GenerationUsage | None, *, output_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic's usage: input tokens computed (those read from the prefix cache apart), output."""
    prompt = usage.prompt_tokens if usage else 0
    cached = usage.cached_tokens if usage else 0
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens
        if output_tokens is not None
        else (usage.completion_tokens if usage else 0),
    }


def stop_fields(finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
    """stop_reason and stop_sequence of a chat finish_reason (after tool calls were read)."""
    if finish_reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(plan: GenerationPlan, choice: CollectedChoice, usage: GenerationUsage) -> dict[str, Any]:
    message, finish_reason = chat_message(plan, choice.text, choice.finish_reason)
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _tool_input(function["arguments"]),
            }
        )
    return {
        "id": message_id(plan),
        "type": "message",
        "role": "assistant",
        "model": plan.served_model,
        "content": content,
        **stop_fields(finish_reason, choice.stop_reason),
        "usage": usage_body(usage),
    }


class MessageStream:
    """One streamed message: each item of the event stream in, Anthropic's events out. Text and
    each tool call are content blocks of their own, numbered in order."""

    def __init__(self, plan: GenerationPlan) -> None:
        self.plan = plan
        self._parser = ChoiceMessageStream(plan) if plan.parses_message else None
        self._open: str | None = None  # the kind of the open block: text | tool_use
        self._index = -1
        self._finish: dict[str, Any] = {}

    def start(self, prompt_tokens: int) -> list[tuple[str, dict[str, Any]]]:
        message = {
            "id": message_id(self.plan),
            "type": "message",
            "role": "assistant",
            "model": self.plan.served_model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage_body(None), "input_tokens": prompt_tokens, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def feed(self, item: ChoiceDelta | ChoiceFinished) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(item, ChoiceFinished):
            reason = item.finish_reason
            deltas: list[dict[str, Any]] = []
            if self._parser is not None:
                deltas, reason = self._parser.finish(reason)
            events = self._events(deltas)
            self._finish = stop_fields(reason, item.stop_reason)
            return events + self._close()
        deltas = self._parser.feed(item.text) if self._parser is not None else [{"content": item.text}]
        return self._events(deltas)

    def end(self, usage: GenerationUsage) -> list[tuple[str, dict[str, Any]]]:
        finish = self._finish or stop_fields(None, None)
        return [
            *self._close(),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": finish,
                    "usage": {"output_tokens": usage.completion_tokens},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _begin(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self._index += 1
        self._open = block["type"]
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": block},
            )
        )
        return events

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _events(self, deltas: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        for delta in deltas:
            if delta.get("content"):
                if self._open != "text":
                    events += self._begin({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id") is not None:
                    events += self._begin(
                        {"type": "tool_use", "id": call["id"], "name": function.get("name"), "input": {}}
                    )
                if function.get("arguments") and self._open == "tool_use":
                    events.append(
                        self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
                    )
            # reasoning_content: the Messages API's thinking blocks need signatures; not sent.
        return events


def _event(name: str, body: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


async def message_events(generation: Generation, events: AsyncIterator) -> AsyncIterator[bytes]:
    plan = generation.plan
    stream = MessageStream(plan)
    try:
        for name, body in stream.start(len(plan.prompts[0])):
            yield _event(name, body)
        async for item in events:
            if isinstance(item, ChoiceDelta) and not item.text:
                continue
            if isinstance(item, ChoiceDelta | ChoiceFinished):
                for name, body in stream.feed(item):
                    yield _event(name, body)
        for name, body in stream.end(generation.usage):
            yield _event(name, body)
    except PlatformError as exc:
        yield _event("error", error_body(exc))
    except Exception:
        logger.exception("stream %s failed", plan.request_id)
        yield _event("error", error_body(PlatformError()))


def message_stream_response(generation: Generation, events: AsyncIterator) -> StreamingHttpResponse:
    response = StreamingHttpResponse(message_events(generation, events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
