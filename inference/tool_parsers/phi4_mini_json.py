"""`phi4_mini_json`: Phi-4-mini's calls, `functools[{"name": ..., "arguments": {...}}, ...]`, as
vLLM's phi4_mini_json parser reads them (which also takes "parameters" for "arguments")."""

from __future__ import annotations

from inference.tool_parsers.base import (
    JSON_DECODER,
    MarkerStream,
    ToolCall,
    call_from,
    parse_by_streaming,
)

LABEL = "phi4_mini_json (functools[...] JSON: Phi-4-mini)"

# The bracket is part of the marker: "functools" alone is a word of any answer about Python, and
# a marker with no call after it holds the stream back until the next marker or the end.
MARKER = "functools["


def read_calls(text: str) -> tuple[list[tuple[str, str]], str] | None:
    """The calls of the array that `functools[` opened, and the text after it."""
    try:
        value, end = JSON_DECODER.raw_decode("[" + text)
    except ValueError:
        return None
    calls = [call_from(item, ("arguments", "parameters")) for item in value]
    found = [call for call in calls if call is not None]
    if not found or len(found) < len(calls):
        return None
    return found, text[end - 1 :]


class Phi4MiniJsonParser:
    """Content, then `functools[...]`: a JSON array of calls (Phi-4-mini-instruct)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_by_streaming(self, text)

    def stream(self) -> MarkerStream:
        return MarkerStream(MARKER, read_calls)
