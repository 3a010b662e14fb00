"""An Anthropic Messages body read into the chat completion body it asks for.

The Messages API is a second wire format over the same generation: `system`, the turns with their
text, tool_use and tool_result blocks, the tools and tool_choice map one to one onto a chat
completion's messages, tools and tool_choice, so the one chat planner (chat template, tool calling,
limits, fair share, ledger) serves both. What the chat format cannot express is refused here with
the Messages field's own name: images and documents, extended thinking.
"""

from __future__ import annotations

import json
from typing import Any

from core.errors import InvalidRequestError

# Fields of a Messages body, and what each becomes.
KNOWN_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "stream",
        "thinking",
        "output_config",
        "service_tier",
    }
)
# Sent by Anthropic's clients for what a self-hosted model has no use for (prompt caching is
# automatic here; placement, speed and workspace are Anthropic's): accepted, ignored.
IGNORED_FIELDS = frozenset(
    {
        "cache_control",
        "container",
        "context_management",
        "diagnostics",
        "inference_geo",
        "mcp_servers",
        "speed",
        "user_profile_id",
        "workspace_id",
    }
)
# Fields of count_tokens: the prompt's, without the sampling ones.
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})

MAX_TOOLS = 128


def _fail(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    for name in body:
        if name not in known and name not in IGNORED_FIELDS:
            raise _fail(f"{name}: Extra inputs are not permitted", name)


def _text_of(blocks: Any, param: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _fail(f"{param} must be a string or a list of content blocks.", param)
    parts = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise _fail(f"{where} must be a text block here.", where)
        parts.append(block["text"])
    return "".join(parts)


def _unsupported_block(kind: str, where: str) -> InvalidRequestError:
    if kind in ("image", "document", "search_result"):
        return _fail(f"{where}: {kind} blocks are not supported by this server (text models only).", where)
    return _fail(f"{where}: content blocks of type {kind!r} are not supported.", where)


def _user_turn(content: Any, i: int) -> list[dict[str, Any]]:
    """A user turn as chat messages: its tool results (one `tool` message each), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _fail(
            f"messages[{i}].content must be a string or a non-empty list of blocks.", f"messages.{i}.content"
        )
    results: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _fail(f"{where}.tool_use_id must be a non-empty string.", f"{where}.tool_use_id")
            output = _text_of(block.get("content", ""), f"{where}.content")
            if block.get("is_error"):
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise _unsupported_block(str(kind), where)
    return results + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant_turn(content: Any, i: int) -> dict[str, Any]:
    """An assistant turn: its text, and its tool_use blocks as tool calls (thinking is dropped)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _fail(f"messages[{i}].content must be a string or a list of blocks.", f"messages.{i}.content")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise _fail(f"{where}: a tool_use block needs an id and a name.", where)
            if not isinstance(arguments, dict):
                raise _fail(f"{where}.input must be an object.", f"{where}.input")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model's earlier thinking is not part of the next prompt
        else:
            raise _unsupported_block(str(kind), where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _fail("messages: at least one message is required.", "messages")
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text_of(body["system"], "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role == "user":
            out += _user_turn(turn.get("content"), i)
        elif role == "assistant":
            out.append(_assistant_turn(turn.get("content"), i))
        else:
            raise _fail(f"messages.{i}.role must be user or assistant, got {role!r}.", f"messages.{i}.role")
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _fail(f"tools must be a list of at most {MAX_TOOLS} tools.", "tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _fail(f"tools.{k} must be an object.", f"tools.{k}")
        if tool.get("type") not in (None, "custom"):
            # A server tool (web search, code execution, ...): Anthropic runs those, this server
            # cannot; left out of the prompt, as a client sending its usual tools expects.
            continue
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _fail(f"tools.{k}.name must be a non-empty string.", f"tools.{k}.name")
        if not isinstance(schema, dict):
            raise _fail(f"tools.{k}.input_schema must be a JSON schema object.", f"tools.{k}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[Any, bool | None]:
    """(the chat tool_choice, parallel_tool_calls) of a Messages tool_choice."""
    choice = body.get("tool_choice")
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise _fail("tool_choice must be an object with a type.", "tool_choice")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return (kind if tools else "none"), parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not any(t["function"]["name"] == name for t in tools):
            raise _fail(f"tool_choice names {name!r}, which is not in tools.", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise _fail("tool_choice.type must be auto, any, tool or none.", "tool_choice.type")


def _thinking(body: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") != "disabled":
        raise _fail(
            "Extended thinking is not supported by this server; leave thinking out or disable it.", "thinking"
        )


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """output_config.format (a JSON schema the answer must follow) as a chat response_format;
    output_config.effort is for reasoning models and changes nothing here."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise _fail("output_config must be an object.", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise _fail(
            'output_config.format must be {"type": "json_schema", "schema": {...}}.', "output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_prompt_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of the prompt a Messages body makes: messages, tools and tool_choice."""
    _thinking(body)
    tools = _tools(body)
    choice, parallel = _tool_choice(body, tools)
    fields: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    if tools:
        fields["tools"] = tools
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    return fields


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion body of a Messages body; InvalidRequestError for what it cannot carry."""
    _check_fields(body, KNOWN_FIELDS)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _fail("max_tokens: a positive integer is required.", "max_tokens")
    chat = chat_prompt_fields(body)
    chat["max_completion_tokens"] = max_tokens
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _fail("metadata must be an object.", "metadata")
        user = metadata.get("user_id")
        if user is not None:
            if not isinstance(user, str):
                raise _fail("metadata.user_id must be a string.", "metadata.user_id")
            chat["user"] = user[:64]
    return chat


def count_tokens_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of a count_tokens body."""
    _check_fields(body, COUNT_FIELDS)
    return chat_prompt_fields(body)
