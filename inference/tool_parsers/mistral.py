"""`mistral`: Mistral's calls after its [TOOL_CALLS] token (Mistral, Mixtral, Mistral Small, Devstral),
in both formats vLLM's mistral parser reads:

- tokenizers before v11 (Mistral 7B v0.3, Mixtral 8x22B): `[TOOL_CALLS] [{"name": ..., "arguments":
  {...}}, ...]`, one JSON array of calls;
- v11 and later (Mistral Small 3.2, Devstral, Magistral): `[TOOL_CALLS]name[ARGS]{...}` per call
  (`[TOOL_CALLS]name{...}` where the decoding drops [ARGS]).

[TOOL_CALLS] is a special token, which the engine's detokenizer drops unless it is told to keep
special tokens: a plan for this parser keeps them (inference.tool_parsers.KEEPS_SPECIAL_TOKENS).
"""

from __future__ import annotations

import re

from inference.tool_parsers.base import (
    JSON_DECODER,
    MarkerStream,
    ToolCall,
    call_from,
    parse_by_streaming,
)

LABEL = "mistral ([TOOL_CALLS]: Mistral, Mixtral, Mistral Small, Devstral)"

MARKER = "[TOOL_CALLS]"
# v11 and later: the name, the model's own call id after [CALL_ID] where it writes one (a call
# gets an id of ours, as every parser's does), [ARGS] (which a decoding that skips special tokens
# leaves out), then the arguments.
_CALL_HEAD = re.compile(r"([\w.:-]+)\s*(?:\[CALL_ID\]\s*\w*\s*)?(?:\[ARGS\]\s*)?")


def read_calls(text: str) -> tuple[list[tuple[str, str]], str] | None:
    """The calls at the start of the text after [TOOL_CALLS], and the text after them."""
    body = text.lstrip()
    try:
        if body.startswith(("[", "{")):  # before v11: a JSON array of calls (or one call)
            value, end = JSON_DECODER.raw_decode(body)
            calls = [
                call_from(item, ("arguments",)) for item in (value if isinstance(value, list) else [value])
            ]
        else:
            head = _CALL_HEAD.match(body)
            if head is None:
                return None
            arguments, end = JSON_DECODER.raw_decode(body, head.end())
            calls = [call_from({"name": head[1], "arguments": arguments}, ("arguments",))]
    except ValueError:
        return None
    found = [call for call in calls if call is not None]
    if not found or len(found) < len(calls):
        return None
    return found, body[end:]


class MistralParser:
    """Content, then `[TOOL_CALLS]` and the calls in either of Mistral's formats."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_by_streaming(self, text)

    def stream(self) -> MarkerStream:
        return MarkerStream(MARKER, read_calls)
