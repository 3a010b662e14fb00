"""A chat choice's generated text as an OpenAI assistant message: reasoning (vLLM's
`reasoning_content`, where the deployment has a reasoning parser: inference.reasoning), content and
tool calls (read as the request's tool mode says: inference.tool_parsers), whole or as stream
deltas. Tool calls are read from the content, after the reasoning."""

from __future__ import annotations

from typing import Any

from inference.reasoning import ReasoningStream, split
from inference.services import GenerationPlan
from inference.tool_parsers import (
    ContentDelta,
    NamedToolStream,
    RequiredToolStream,
    ToolCall,
    ToolCallDelta,
    get_parser,
    parse_named,
    parse_required,
)


def _call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(
    plan: GenerationPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice and its finish_reason (tool_calls when the
    message calls tools and was not cut short)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if plan.reasoning_parser:
        message["reasoning_content"], content = split(plan.reasoning_parser, text)
        message["content"], text = content, content or ""
    if plan.tool_mode is None:
        return message, finish_reason
    if plan.tool_mode == "auto":
        content, calls = get_parser(plan.tool_parser).parse(text)
    elif plan.tool_mode == "named":
        content, calls = None, parse_named(plan.tool_name or "", text)
    else:
        content, calls = None, parse_required(text)
    message["content"] = content if content or not plan.reasoning_parser else None
    if calls:
        message["tool_calls"] = [_call_body(c) for c in calls]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


def _delta_body(delta: ContentDelta | ToolCallDelta) -> dict[str, Any]:
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    call: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.id is not None:
        call.update(id=delta.id, type="function")
        function = {"name": delta.name, "arguments": delta.arguments}
    call["function"] = function
    return {"tool_calls": [call]}


class ChoiceMessageStream:
    """One streamed choice of a chat with tools or a reasoning parser (plan.parses_message): each
    text piece in, message deltas out."""

    def __init__(self, plan: GenerationPlan) -> None:
        self._reasoning = ReasoningStream(plan.reasoning_parser) if plan.reasoning_parser else None
        self._stream: Any = None
        if plan.tool_mode == "auto":
            self._stream = get_parser(plan.tool_parser).stream()
        elif plan.tool_mode == "named":
            self._stream = NamedToolStream(plan.tool_name or "")
        elif plan.tool_mode == "required":
            self._stream = RequiredToolStream()

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._bodies(self._reasoning.feed(text) if self._reasoning else [("content", text)])

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        deltas = self._bodies(self._reasoning.finish() if self._reasoning else [])
        if self._stream is not None:
            deltas += [_delta_body(d) for d in self._stream.finish()]
            if self._stream.called and finish_reason == "stop":
                finish_reason = "tool_calls"
        return deltas, finish_reason

    def _bodies(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self._stream is not None:
                out += [_delta_body(d) for d in self._stream.feed(text)]
            else:
                out.append({"content": text})
        return out
