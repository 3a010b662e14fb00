"""`hermes`: calls as JSON objects between <tool_call> and </tool_call> (Hermes, Qwen, SmolLM)."""

from __future__ import annotations

from inference.tool_parsers.base import (
    Delta,
    ToolCall,
    ToolCallDelta,
    Trimmed,
    call_from,
    held_prefix,
    loads_json,
    new_call_id,
    parse_by_streaming,
)

LABEL = "hermes (<tool_call> JSON: Hermes, Qwen, SmolLM)"


class HermesStream:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._content = Trimmed()
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
                    keep = held_prefix(self._buffer, self.OPEN)
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
            call = call_from(loads_json(body), ("arguments",))
        except ValueError:
            call = None
        if call is None:  # not a call: the tag stays in the content, as vLLM leaves it
            return self._content(self.OPEN + body + close)
        self._num_calls += 1
        return [ToolCallDelta(self._num_calls - 1, new_call_id(), call[0], call[1])]


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, zero or more, with text
    around them (Hermes, Qwen2.5, SmolLM2)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_by_streaming(self, text)

    def stream(self) -> HermesStream:
        return HermesStream()
