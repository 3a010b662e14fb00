"""A Responses answer, from the one generation's events: the response object of a finished choice
(output items: reasoning, the message with its output_text, function calls), or the stream of typed
events with sequence numbers that the SDK's `responses.stream()` assembles."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from inference.api.chat_completions.messages import ChoiceMessageStream, chat_message
from inference.services import ChoiceDelta, ChoiceFinished, GenerationPlan, GenerationUsage


def response_id(plan: GenerationPlan) -> str:
    return f"resp_{plan.request_id}"


def usage_body(usage: GenerationUsage | None) -> dict[str, Any]:
    prompt = usage.prompt_tokens if usage else 0
    output = usage.completion_tokens if usage else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens if usage else 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def response_object(
    plan: GenerationPlan,
    echo: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: GenerationUsage | None,
    store: bool,
    previous_response_id: str | None,
    finish_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object, in the state `status` says: in_progress (no usage yet), completed,
    incomplete (cut by max_output_tokens) or failed (with its error)."""
    body: dict[str, Any] = {
        "id": response_id(plan),
        "object": "response",
        "created_at": plan.created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": plan.served_model,
        "output": output,
        "previous_response_id": previous_response_id,
        "service_tier": plan.service_tier,
        "store": store,
        "truncation": "disabled",
        "usage": usage_body(usage) if usage is not None else None,
        **echo,
    }
    if status == "completed":
        body["completed_at"] = int(time.time())
    return body


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)] if status == "completed" else [],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": "completed"}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(plan: GenerationPlan, message: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a chat assistant message: reasoning, text, function calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(f"rs_{plan.request_id}", message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(f"msg_{plan.request_id}", message["content"]))
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        items.append(
            _call_item(f"fc_{plan.request_id}_{i}", call["id"], function["name"], function["arguments"])
        )
    return items


def assistant_message(output: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """What a response's output adds to the conversation: one chat assistant message (its text and
    tool calls; the reasoning is not carried to the next turn)."""
    text, calls = [], []
    for item in output:
        if item["type"] == "message":
            text += [part["text"] for part in item["content"]]
        elif item["type"] == "function_call":
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def whole_output(
    plan: GenerationPlan, text: str, finish_reason: str | None
) -> tuple[list[dict[str, Any]], str]:
    """The output items and status of a finished choice."""
    message, finish_reason = chat_message(plan, text, finish_reason)
    return output_items(plan, message), status_of(finish_reason)


Event = tuple[str, dict[str, Any]]


class ResponseStream:
    """One streamed response: each item of the event stream in, the Responses events out (without
    sequence numbers: the writer numbers what it sends). Reasoning, text and each function call are
    output items of their own, each opened (output_item.added), fed, and closed (.done events,
    output_item.done) before the next one opens."""

    def __init__(self, plan: GenerationPlan) -> None:
        self.plan = plan
        self._parser = ChoiceMessageStream(plan) if plan.parses_message else None
        self.output: list[dict[str, Any]] = []  # closed items, in order
        self._open: dict[str, Any] | None = None
        self._calls = 0
        self.finish_reason: str | None = None

    @property
    def _index(self) -> int:
        return len(self.output)

    def feed(self, item: ChoiceDelta | ChoiceFinished) -> list[Event]:
        if isinstance(item, ChoiceFinished):
            reason = item.finish_reason
            deltas: list[dict[str, Any]] = []
            if self._parser is not None:
                deltas, reason = self._parser.finish(reason)
            self.finish_reason = reason
            return self._events(deltas) + self._close()
        deltas = self._parser.feed(item.text) if self._parser is not None else [{"content": item.text}]
        return self._events(deltas)

    def close(self) -> list[Event]:
        return self._close()

    def _open_item(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[Event]:
        events = self._close()
        self._open = {"item": item, "text": []}
        events.append(("response.output_item.added", {"output_index": self._index, "item": item}))
        if part is not None:
            events.append(
                (
                    "response.content_part.added",
                    {"item_id": item["id"], "output_index": self._index, "content_index": 0, "part": part},
                )
            )
        return events

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        item, text = self._open["item"], "".join(self._open["text"])
        self._open = None
        where = {"item_id": item["id"], "output_index": self._index}
        events: list[Event] = []
        if item["type"] == "message":
            part = _text_part(text)
            done = _message_item(item["id"], text)
            events += [
                ("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []}),
                ("response.content_part.done", {**where, "content_index": 0, "part": part}),
            ]
        elif item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text)
            events += [
                ("response.reasoning_text.done", {**where, "content_index": 0, "text": text}),
                (
                    "response.content_part.done",
                    {**where, "content_index": 0, "part": {"type": "reasoning_text", "text": text}},
                ),
            ]
        else:
            done = {**item, "arguments": text, "status": "completed"}
            events.append(
                ("response.function_call_arguments.done", {**where, "name": item["name"], "arguments": text})
            )
        events.append(("response.output_item.done", {"output_index": self._index, "item": done}))
        self.output.append(done)
        return events

    def _kind(self) -> str | None:
        return self._open["item"]["type"] if self._open is not None else None

    def _events(self, deltas: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                if self._kind() != "reasoning":
                    item = {
                        "type": "reasoning",
                        "id": f"rs_{self.plan.request_id}",
                        "summary": [],
                        "content": [],
                    }
                    events += self._open_item(item, {"type": "reasoning_text", "text": ""})
                events.append(self._text_delta("response.reasoning_text.delta", delta["reasoning_content"]))
            if delta.get("content"):
                if self._kind() != "message":
                    item = _message_item(f"msg_{self.plan.request_id}", "", status="in_progress")
                    events += self._open_item(item, _text_part(""))
                events.append(self._text_delta("response.output_text.delta", delta["content"]))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id") is not None:
                    item_id = f"fc_{self.plan.request_id}_{self._calls}"
                    self._calls += 1
                    item = _call_item(
                        item_id, call["id"], function.get("name") or "", "", status="in_progress"
                    )
                    events += self._open_item(item, None)
                if function.get("arguments") and self._kind() == "function_call":
                    assert self._open is not None
                    self._open["text"].append(function["arguments"])
                    events.append(
                        (
                            "response.function_call_arguments.delta",
                            {
                                "item_id": self._open["item"]["id"],
                                "output_index": self._index,
                                "delta": function["arguments"],
                            },
                        )
                    )
        return events

    def _text_delta(self, name: str, text: str) -> Event:
        assert self._open is not None
        self._open["text"].append(text)
        body = {
            "item_id": self._open["item"]["id"],
            "output_index": self._index,
            "content_index": 0,
            "delta": text,
        }
        if name == "response.output_text.delta":
            body["logprobs"] = []
        return name, body
