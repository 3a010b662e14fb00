"""OpenAI tool calls out of a chat completion's generated text, whole or while it streams.

Two kinds of output carry calls:

- free generation in a model's own call format (`hermes`, `llama3_json`): a ToolCallParser finds
  the calls and the text around them, which stays the message's content;
- forced tool choice (`{"type": "function", ...}` or `"required"`), generated under the JSON
  schema of named_tool_schema / required_tools_schema, so the whole output is valid JSON of a
  known shape: NamedToolStream / parse_named and RequiredToolStream / parse_required.

Arguments are the JSON text of an object with the separators of Python's json.dumps (as the
structured output grammar writes JSON), non-ASCII kept as is.

Streams and parse() agree: concatenating a stream's ContentDelta texts gives exactly parse()'s
content when the text holds a call, and the text stripped of surrounding whitespace when it holds
none (parse() then returns the text unchanged); concatenating a call's argument fragments gives
parse()'s arguments. Streams drop the surrounding whitespace so that a message of calls only does
not stream a "\\n" of content that its non-streamed form (content None) would not have.

Standard library only: no Django, no torch.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


Delta = ContentDelta | ToolCallDelta


class ToolCallStream(Protocol):
    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...

    @property
    def called(self) -> bool: ...


class ToolCallParser(Protocol):
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]: ...

    def stream(self) -> ToolCallStream: ...


def _new_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json accepts NaN and Infinity, which no client's JSON parser would take back.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _loads(text: str) -> Any:
    return _DECODER.decode(text)


def _call_from(value: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded `{"name": ..., <argument key>: {...}}`, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], _dumps(arguments)


def _collect(deltas: list[Delta]) -> tuple[str, list[ToolCall]]:
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif delta.id is not None:
            assert delta.index == len(calls) and delta.name is not None
            calls.append(ToolCall(delta.id, delta.name, delta.arguments))
        else:
            calls[delta.index].arguments += delta.arguments
    return "".join(content), calls


def _parse_by_streaming(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    # One implementation for both paths, so that they cannot disagree on an edge case.
    stream = parser.stream()
    content, calls = _collect(stream.feed(text) + stream.finish())
    if not calls:
        return text, []
    return content or None, calls


class _Trimmed:
    """Content deltas without the content's surrounding whitespace: leading whitespace is dropped
    and trailing whitespace is held until more content follows it (a call between does not)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def __call__(self, text: str) -> list[Delta]:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if not body:
            self._held += text
            return []
        out = self._held + body
        self._held = text[len(body) :]
        return [ContentDelta(out)]


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesStream:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._content = _Trimmed()
        self._buffer = ""  # outside a tag: a held suffix that may begin OPEN; inside: the body
        self._inside = False
        self._searched = 0  # the body before this holds no CLOSE
        self._num_calls = 0

    @property
    def called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._buffer += text
        while True:
            if self._inside:
                end = self._buffer.find(self.CLOSE, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buffer) - len(self.CLOSE) + 1)
                    return out
                out += self._tag(self._buffer[:end], self.CLOSE)
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._inside = False
            else:
                start = self._buffer.find(self.OPEN)
                if start < 0:
                    keep = _held_prefix(self._buffer, self.OPEN)
                    out += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.OPEN) :]
                self._inside, self._searched = True, 0

    def finish(self) -> list[Delta]:
        # Models often stop before the close tag: the body of a final unclosed tag may be a call.
        out = self._tag(self._buffer, "") if self._inside else self._content(self._buffer)
        self._buffer, self._inside = "", False
        return out

    def _tag(self, body: str, close: str) -> list[Delta]:
        try:
            call = _call_from(_loads(body), ("arguments",))
        except ValueError:
            call = None
        if call is None:  # not a call: the tag stays in the content, as vLLM leaves it
            return self._content(self.OPEN + body + close)
        self._num_calls += 1
        return [ToolCallDelta(self._num_calls - 1, _new_id(), call[0], call[1])]


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, zero or more, with text
    around them (Hermes, Qwen2.5, SmolLM2)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return _parse_by_streaming(self, text)

    def stream(self) -> HermesStream:
        return HermesStream()


_PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    body = text.lstrip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    calls: list[tuple[str, str]] = []
    position = 0
    while True:
        try:
            value, position = _DECODER.raw_decode(body, position)
        except ValueError:
            return None
        call = _call_from(value, ("parameters", "arguments"))
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
        self._content = _Trimmed()
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
        return [ToolCallDelta(i, _new_id(), name, args) for i, (name, args) in enumerate(calls)]

    def _flush(self) -> str:
        text, self._buffer = self._buffer, ""
        return text


class Llama3JsonParser:
    """The whole output is `{"name": ..., "parameters": {...}}`, or several joined by `;`, after an
    optional `<|python_tag|>` (Llama 3.1 / 3.2 JSON tool calling)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return _parse_by_streaming(self, text)

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()


PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; known parsers: {', '.join(sorted(PARSERS))}"
        ) from None


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
            self._id = _new_id()
            return [ToolCallDelta(0, self._id, self._name, text)]
        return [ToolCallDelta(0, None, None, text)] if text else []

    def finish(self) -> list[ToolCallDelta]:
        # The call is forced: an empty output still made one.
        return self.feed("") if self._id is None else []


def parse_named(name: str, text: str) -> list[ToolCall]:
    try:
        arguments = _dumps(_loads(text))
    except ValueError:  # e.g. cut by max_tokens: the client gets what was generated
        arguments = text
    return [ToolCall(_new_id(), name, arguments)]


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
                call = _call_from(_loads(element), ("parameters",))
            except ValueError:
                call = None
            if call is not None:  # the grammar makes every element a call; skip rather than fail
                out.append(ToolCallDelta(self._num_calls, _new_id(), call[0], call[1]))
                self._num_calls += 1
        return out

    def finish(self) -> list[ToolCallDelta]:
        return []  # an element still open was cut (max_tokens): there is no call to recover from it


def parse_required(text: str) -> list[ToolCall]:
    stream = RequiredToolStream()
    _, calls = _collect(list(stream.feed(text)))
    return calls
