"""A Responses API body read into the chat completion body it asks for.

The Responses API is another wire format over the same generation: `instructions` and the input
items (messages, function calls and their outputs) become a chat's messages, flat function tools
become chat tools, `text.format` a response_format, `max_output_tokens` max_completion_tokens; the
one chat planner (template, tool calling, structured outputs, limits, fair share, ledger) serves
it. Hosted tools (web search, file search, ...) are run by OpenAI, not by a self-hosted model:
they are left out of the prompt, as clients that always send them (Codex) expect.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from core.errors import InvalidRequestError

KNOWN_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "metadata",
        "user",
        "safety_identifier",
        "service_tier",
        "store",
        "previous_response_id",
        "reasoning",
        "include",
        "prompt_cache_key",
        "background",
        "truncation",
        "top_logprobs",
    }
)
# Sent by clients for what changes nothing here: Codex's client_metadata, the SDK's stream
# obfuscation, the cache retention of OpenAI's prompt cache (caching is automatic here).
IGNORED_FIELDS = frozenset(
    {
        "client_metadata",
        "stream_options",
        "prompt_cache_retention",
        "prompt_cache_options",
        "context_management",
        "max_tool_calls",
    }
)

MAX_TOOLS = 128
MAX_ITEMS = 4096
# Part and item types of the input a text model can take, and what each is.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
# Tool types the platform does not run: left out of the prompt. Everything else but `function`
# is refused by name, so a new kind of client tool is not silently dropped.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "image_generation",
        "code_interpreter",
        "computer_use",
        "computer_use_preview",
        "computer",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
        "namespace",
        "tool_search",
    }
)


def _fail(message: str, param: str | None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _type_of(value: Any) -> str | None:
    """The `type` of an object of the body, when it is a string."""
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseInput:
    """A Responses body read: the chat body to run, the input items as they will be listed
    (`GET /v1/responses/{id}/input_items`, each with an id) and this turn's input as chat messages
    (instructions apart: they are not carried to the next turn)."""

    chat: dict[str, Any]
    items: list[dict[str, Any]] = field(default_factory=list)
    turn_messages: list[dict[str, Any]] = field(default_factory=list)
    store: bool = True
    previous_response_id: str | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def _check_fields(body: dict[str, Any]) -> None:
    for name in body:
        if name not in KNOWN_FIELDS and name not in IGNORED_FIELDS:
            raise _fail(f"{name}: Extra inputs are not permitted", name)


def _part_text(part: Any, where: str) -> str:
    kind = _type_of(part)
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind in ("input_image", "input_file", "input_audio"):
        raise _fail(f"{where}: {kind} parts are not supported by this server (text models only).", where)
    raise _fail(f"{where} must be a text part (input_text or output_text).", where)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(f"{where} must be a string or a list of content parts.", where)
    return "".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))


def _listed_message(role: str, text: str, item: dict[str, Any]) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": text}
    if kind == "output_text":
        part["annotations"] = []
    return {
        "type": "message",
        "id": item.get("id") if isinstance(item.get("id"), str) else new_item_id("msg"),
        "role": role,
        "status": "completed",
        "content": [part],
    }


class _Turns:
    """Input items in, chat messages out: consecutive function calls join the assistant message
    before them (one message, several tool calls), as a chat template expects."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []

    def message(self, item: dict[str, Any], i: int) -> None:
        role = item.get("role")
        if not isinstance(role, str) or role not in _MESSAGE_ROLES:
            raise _fail(
                f"input.{i}.role must be one of {sorted(_MESSAGE_ROLES)}, got {role!r}.", f"input.{i}.role"
            )
        text = _content_text(item.get("content"), f"input.{i}.content")
        self.messages.append({"role": role, "content": text})
        self.items.append(_listed_message(role, text, item))

    def function_call(self, item: dict[str, Any], i: int) -> None:
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
            raise _fail(f"input.{i}: a function_call item needs a call_id and a name.", f"input.{i}")
        if not isinstance(arguments, str):
            raise _fail(f"input.{i}.arguments must be a string of JSON.", f"input.{i}.arguments")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            if last.get("content") == "":
                last["content"] = None
        else:
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        self.items.append(
            {
                "type": "function_call",
                "id": item.get("id") if isinstance(item.get("id"), str) else new_item_id("fc"),
                "call_id": call_id,
                "name": name,
                "arguments": arguments,
                "status": "completed",
            }
        )

    def function_call_output(self, item: dict[str, Any], i: int) -> None:
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise _fail(f"input.{i}.call_id must be a non-empty string.", f"input.{i}.call_id")
        text = _content_text(output, f"input.{i}.output")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        self.items.append(
            {
                "type": "function_call_output",
                "id": item.get("id") if isinstance(item.get("id"), str) else new_item_id("fco"),
                "call_id": call_id,
                "output": text,
                "status": "completed",
            }
        )


def _input(value: Any) -> _Turns:
    turns = _Turns()
    if value is None:
        return turns
    if isinstance(value, str):
        turns.message({"role": "user", "content": value}, 0)
        return turns
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise _fail(f"input must be a string or a list of at most {MAX_ITEMS} items.", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _fail(f"input.{i} must be an object.", f"input.{i}")
        kind = _type_of(item) or ("message" if "type" not in item and "role" in item else None)
        if kind == "message":
            turns.message(item, i)
        elif kind == "function_call":
            turns.function_call(item, i)
        elif kind == "function_call_output":
            turns.function_call_output(item, i)
        elif kind == "reasoning":
            continue  # the model's earlier reasoning is not part of the next prompt
        elif kind == "item_reference":
            raise _fail(
                f"input.{i}: item references are not supported; send the item, or previous_response_id.",
                f"input.{i}.type",
            )
        else:
            raise _fail(f"input.{i}: input items of type {kind!r} are not supported.", f"input.{i}.type")
    return turns


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _fail(f"tools must be a list of at most {MAX_TOOLS} tools.", "tools")
    out = []
    for k, tool in enumerate(tools):
        kind = _type_of(tool)
        if kind in HOSTED_TOOLS:
            continue
        if kind != "function":
            raise _fail(f"tools.{k}: tools of type {kind!r} are not supported.", f"tools.{k}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(f"tools.{k}.name must be a non-empty string.", f"tools.{k}.name")
        function: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """The chat tool_choice of a Responses one, and the tools it leaves callable."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return (choice if tools or choice is None else "none"), tools
    if not isinstance(choice, dict):
        raise _fail("tool_choice must be auto, none, required or an object.", "tool_choice")
    kind = _type_of(choice)
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not any(t["function"]["name"] == name for t in tools):
            raise _fail(f"tool_choice names {name!r}, which is not a function tool.", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise _fail(
                "tool_choice: allowed_tools needs a mode (auto or required) and tools.", "tool_choice"
            )
        names = {
            t.get("name") for t in allowed if _type_of(t) == "function" and isinstance(t.get("name"), str)
        }
        kept = [t for t in tools if t["function"]["name"] in names]
        return (mode if kept else "none"), kept
    if kind in HOSTED_TOOLS:
        raise _fail(f"tool_choice: {kind} tools are not run by this server.", "tool_choice.type")
    raise _fail("tool_choice.type must be function or allowed_tools.", "tool_choice.type")


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _fail("text must be an object.", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = _type_of(fmt)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _fail("text.format.schema must be a JSON schema object.", "text.format.schema")
        spec: dict[str, Any] = {"name": fmt.get("name") or "output", "schema": schema}
        for key in ("strict", "description"):
            if fmt.get(key) is not None:
                spec[key] = fmt[key]
        return {"type": "json_schema", "json_schema": spec}
    raise _fail("text.format.type must be text, json_object or json_schema.", "text.format.type")


def _checked_options(body: dict[str, Any]) -> None:
    if body.get("background"):
        raise _fail(
            "background responses are not supported: send the request with stream: true, or wait for it.",
            "background",
        )
    if body.get("truncation") not in (None, "disabled"):
        raise _fail(
            "truncation: only disabled is supported (a prompt longer than the context is refused).",
            "truncation",
        )
    for name, kind in (("reasoning", dict), ("metadata", dict), ("include", list)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise _fail(f"{name} must be {'an object' if kind is dict else 'a list'}.", name)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _fail("previous_response_id must be a response id.", "previous_response_id")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise _fail("store must be a boolean.", "store")


def response_input(body: dict[str, Any]) -> ResponseInput:
    """A Responses body read: InvalidRequestError (naming the field) for what it cannot carry. The
    conversation of `previous_response_id`, if any, is for the caller to put before
    `turn_messages` (see `chat_messages`)."""
    _check_fields(body)
    _checked_options(body)
    turns = _input(body.get("input"))
    tools = _tools(body)
    choice, tools = _tool_choice(body, tools)
    chat: dict[str, Any] = {"model": body.get("model")}
    if tools:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    for name in ("temperature", "top_p", "stream", "parallel_tool_calls", "service_tier", "metadata"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None:
            chat[name] = body[name]
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _fail("instructions must be a string.", "instructions")
    echo = {
        name: body.get(name)
        for name in ("instructions", "max_output_tokens", "metadata", "user", "safety_identifier")
    }
    echo.update(
        tools=[t for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"],
        tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=body.get("parallel_tool_calls", True),
        text=body.get("text") or {"format": {"type": "text"}},
        reasoning=body.get("reasoning") or {"effort": None, "summary": None},
        temperature=body.get("temperature", 1.0),
        top_p=body.get("top_p", 1.0),
        prompt_cache_key=body.get("prompt_cache_key"),
    )
    return ResponseInput(
        chat=chat,
        items=turns.items,
        turn_messages=turns.messages,
        store=body.get("store", True) is not False,
        previous_response_id=body.get("previous_response_id"),
        echo=echo,
    )


def chat_messages(
    read: ResponseInput, earlier: list[dict[str, Any]], instructions: str | None
) -> list[dict[str, Any]]:
    """The chat messages of a turn: the instructions, the earlier turns, this turn's input. A probe
    without any input (clients test a server so) asks an empty user message."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += earlier + read.turn_messages
    if not any(m["role"] in ("user", "tool") for m in messages):
        messages.append({"role": "user", "content": ""})
    return messages
