"""`llama3_json`: Llama 3.1's JSON tool calls, optionally after <|python_tag|>."""

from __future__ import annotations

from inference.tool_parsers.base import (
    JSON_DECODER,
    Delta,
    ToolCall,
    ToolCallDelta,
    Trimmed,
    call_from,
    new_call_id,
    parse_by_streaming,
)

LABEL = "llama3_json (Llama 3.1 JSON)"


_PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    body = text.lstrip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    calls: list[tuple[str, str]] = []
    position = 0
    while True:
        try:
            value, position = JSON_DECODER.raw_decode(body, position)
        except ValueError:
            return None
        call = call_from(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = body[position:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        rest = rest[1:].lstrip()
        if not rest:  # a trailing separator
            return calls
        position = len(body) - len(rest)


class Llama3JsonStream:
    def __init__(self) -> None:
        self._content = Trimmed()
        self._buffer = ""
        self._mode = "undecided"  # then "text" (streamed as it comes) or "json" (decided at finish)
        self._num_calls = 0

    @property
    def called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "text":
            return self._content(text)
        self._buffer += text
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self._mode = "json"
            elif head and not _PYTHON_TAG.startswith(head):
                self._mode = "text"
                return self._content(self._flush())
        return []

    def finish(self) -> list[Delta]:
        text = self._flush()
        calls = _llama3_calls(text) if self._mode != "text" else None
        if not calls:
            return self._content(text)
        self._num_calls = len(calls)
        return [ToolCallDelta(i, new_call_id(), name, args) for i, (name, args) in enumerate(calls)]

    def _flush(self) -> str:
        text, self._buffer = self._buffer, ""
        return text


class Llama3JsonParser:
    """The whole output is `{"name": ..., "parameters": {...}}`, or several joined by `;`, after an
    optional `<|python_tag|>` (Llama 3.1 / 3.2 JSON tool calling)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_by_streaming(self, text)

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()
