"""Forced tool choice (`{"type": "function", ...}` or `"required"`): the output is generated under
the JSON schema of named_tool_schema / required_tools_schema, so the whole of it is valid JSON of a
known shape: NamedToolStream / parse_named and RequiredToolStream / parse_required read it."""

from __future__ import annotations

from typing import Any

from inference.tool_parsers.base import (
    ToolCall,
    ToolCallDelta,
    call_from,
    collect,
    dumps_arguments,
    loads_json,
    new_call_id,
)

# Forced tool choice: the output is generated under one of these schemas.


def named_tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    # An absent (or empty) parameters schema would let the grammar write any JSON value.
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_tools_schema(tools: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": tool["function"]["name"]},
                "parameters": named_tool_schema(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedToolStream:
    """tool_choice naming a function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._id: str | None = None

    @property
    def called(self) -> bool:
        return self._id is not None

    def feed(self, text: str) -> list[ToolCallDelta]:
        if self._id is None:
            self._id = new_call_id()
            return [ToolCallDelta(0, self._id, self._name, text)]
        return [ToolCallDelta(0, None, None, text)] if text else []

    def finish(self) -> list[ToolCallDelta]:
        # The call is forced: an empty output still made one.
        return self.feed("") if self._id is None else []


def parse_named(name: str, text: str) -> list[ToolCall]:
    try:
        arguments = dumps_arguments(loads_json(text))
    except ValueError:  # e.g. cut by max_tokens: the client gets what was generated
        arguments = text
    return [ToolCall(new_call_id(), name, arguments)]


class _ArrayElements:
    """The text of each element of a streamed JSON array, as soon as the element closes. One pass
    over each piece, keeping string, escape and depth state between pieces."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._closed = False
        self._parts: list[str] = []  # the open element so far

    def feed(self, text: str) -> list[str]:
        elements: list[str] = []
        start: int | None = 0 if self._depth >= 2 else None
        for i, char in enumerate(text):
            if self._closed:
                break
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                # An object at the top is no array of calls (the grammar does not write one).
                self._closed = self._depth == 0 and char == "{"
                self._depth += 1
                if self._depth == 2:
                    start = i
            elif char in "]}":
                self._depth -= 1
                self._closed = self._depth == 0
                if self._depth == 1 and start is not None:
                    self._parts.append(text[start : i + 1])
                    elements.append("".join(self._parts))
                    self._parts, start = [], None
        if start is not None and not self._closed:
            self._parts.append(text[start:])
        return elements


class RequiredToolStream:
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects; each
    call goes out whole as soon as its element closes."""

    def __init__(self) -> None:
        self._elements = _ArrayElements()
        self._num_calls = 0

    @property
    def called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for element in self._elements.feed(text):
            try:
                call = call_from(loads_json(element), ("parameters",))
            except ValueError:
                call = None
            if call is not None:  # the grammar makes every element a call; skip rather than fail
                out.append(ToolCallDelta(self._num_calls, new_call_id(), call[0], call[1]))
                self._num_calls += 1
        return out

    def finish(self) -> list[ToolCallDelta]:
        return []  # an element still open was cut (max_tokens): there is no call to recover from it


def parse_required(text: str) -> list[ToolCall]:
    stream = RequiredToolStream()
    _, calls = collect(list(stream.feed(text)))
    return calls
