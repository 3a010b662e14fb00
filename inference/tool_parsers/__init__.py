"""OpenAI tool calls out of a chat completion's generated text, whole or while it streams (after
vLLM's tool_parsers: one module per model format, behind one interface).

Two kinds of output carry calls:

- free generation in a model's own call format (one module each: `hermes`, `llama3_json`): a
  ToolCallParser finds the calls and the text around them, which stays the message's content;
- forced tool choice (`forced`): the output is valid JSON of a known shape.

PARSERS is the one list of the parsers a deployment may name.
"""

from __future__ import annotations

from collections.abc import Callable

from inference.tool_parsers import hermes, llama3_json
from inference.tool_parsers.base import (
    ContentDelta,
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
)
from inference.tool_parsers.forced import (
    NamedToolStream,
    RequiredToolStream,
    named_tool_schema,
    parse_named,
    parse_required,
    required_tools_schema,
)

# name -> (the parser's class, its label in the admin)
PARSERS: dict[str, tuple[Callable[[], ToolCallParser], str]] = {
    "hermes": (hermes.HermesParser, hermes.LABEL),
    "llama3_json": (llama3_json.Llama3JsonParser, llama3_json.LABEL),
}
DEFAULT_PARSER = "hermes"


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name][0]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; known parsers: {', '.join(sorted(PARSERS))}"
        ) from None


__all__ = [
    "DEFAULT_PARSER",
    "PARSERS",
    "ContentDelta",
    "Delta",
    "NamedToolStream",
    "RequiredToolStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "get_parser",
    "named_tool_schema",
    "parse_named",
    "parse_required",
    "required_tools_schema",
]
