"""What every tool-call parser shares: the calls and deltas it produces, the interface a parser
implements (parse a whole text, or stream one), and the JSON and streaming helpers.

Arguments are the JSON text of an object with the separators of Python's json.dumps (as the
structured output grammar writes JSON), non-ASCII kept as is. Streams and parse() agree:
concatenating a stream's ContentDelta texts gives exactly parse()'s content when the text holds a
call, and the text stripped of surrounding whitespace when it holds none (parse() then returns the
text unchanged); concatenating a call's argument fragments gives parse()'s arguments. Streams drop
the surrounding whitespace so that a message of calls only does not stream a "\\n" of content that
its non-streamed form (content None) would not have.

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


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def dumps_arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json accepts NaN and Infinity, which no client's JSON parser would take back.
JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def loads_json(text: str) -> Any:
    return JSON_DECODER.decode(text)


def call_from(value: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded `{"name": ..., <argument key>: {...}}`, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = loads_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], dumps_arguments(arguments)


def collect(deltas: list[Delta]) -> tuple[str, list[ToolCall]]:
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


def parse_by_streaming(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    # One implementation for both paths, so that they cannot disagree on an edge case.
    stream = parser.stream()
    content, calls = collect(stream.feed(text) + stream.finish())
    if not calls:
        return text, []
    return content or None, calls


class Trimmed:
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


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


# The calls at the start of the text after a marker and the text after them, or None.
CallReader = Callable[[str], tuple[list[tuple[str, str]], str] | None]


class MarkerStream:
    """Calls that follow a marker (Mistral's `[TOOL_CALLS]`, Phi-4-mini's `functools[`), with
    content before it. After each marker, `read` finds the calls at the start of the text and
    returns them with the text after them, which is content again; or None while (or when) that
    text is no call. A marker whose text is no call by the next marker or the end stays content
    with it, as a hermes tag that is no call does."""

    def __init__(self, marker: str, read: CallReader) -> None:
        self._marker = marker
        self._read = read
        self._content = Trimmed()
        self._buffer = ""  # before a marker: a held suffix that may begin one; after: the text since
        self._inside = False
        self._searched = 0  # the text after the marker before this holds no further marker
        self._num_calls = 0

    @property
    def called(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._buffer += text
        while True:
            if self._inside:
                end = self._buffer.find(self._marker, self._searched)
                if end >= 0:
                    out += self._resolve(self._buffer[:end])
                    self._buffer = self._buffer[end + len(self._marker) :]
                    self._searched = 0
                    continue
                self._searched = max(0, len(self._buffer) - len(self._marker) + 1)
                # Calls end in a closing bracket: read again only when one came, not on every piece
                # (a call that ends otherwise is read at the next marker or the end, the same calls).
                read = self._read(self._buffer) if "}" in text or "]" in text else None
                if read is None:
                    return out
                out += self._calls(read[0])
                self._buffer, self._inside = read[1], False
            else:
                start = self._buffer.find(self._marker)
                if start < 0:
                    keep = held_prefix(self._buffer, self._marker)
                    out += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(self._marker) :]
                self._inside, self._searched = True, 0

    def finish(self) -> list[Delta]:
        out = self._resolve(self._buffer) if self._inside else self._content(self._buffer)
        self._buffer, self._inside = "", False
        return out

    def _resolve(self, body: str) -> list[Delta]:
        """The text from a marker to the next marker or the end: calls then content, or content."""
        read = self._read(body)
        if read is None:
            return self._content(self._marker + body)
        return self._calls(read[0]) + self._content(read[1])

    def _calls(self, calls: list[tuple[str, str]]) -> list[Delta]:
        first = self._num_calls
        self._num_calls += len(calls)
        return [ToolCallDelta(first + i, new_call_id(), name, args) for i, (name, args) in enumerate(calls)]
