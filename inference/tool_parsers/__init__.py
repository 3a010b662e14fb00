"""OpenAI tool calls out of a chat completion's generated text, whole or while it streams (after
vLLM's tool_parsers: one module per model format, behind one interface).

Two kinds of output carry calls:

- free generation in a model's own call format (one module each: `hermes`, `llama3_json`,
  `mistral`, `phi4_mini_json`): a ToolCallParser finds the calls and the text around them, which
  stays the message's content;
- forced tool choice (`forced`): the output is valid JSON of a known shape.

PARSERS is the one list of the parsers a deployment may name.
"""

from __future__ import annotations

from collections.abc import Callable

from inference.tool_parsers import hermes, llama3_json, mistral, phi4_mini_json
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
    "mistral": (mistral.MistralParser, mistral.LABEL),
    "phi4_mini_json": (phi4_mini_json.Phi4MiniJsonParser, phi4_mini_json.LABEL),
}
DEFAULT_PARSER = "hermes"
# The parsers whose marker is a special token, which the detokenizer drops unless a request keeps
# special tokens (vLLM's mistral parser turns skip_special_tokens off for the same reason).
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name][0]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; known parsers: {', '.join(sorted(PARSERS))}"
        ) from None


__all__ = [
    "DEFAULT_PARSER",
    "KEEPS_SPECIAL_TOKENS",
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
