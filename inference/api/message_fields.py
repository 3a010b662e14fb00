"""`messages`, the conversation of a chat completion (and of POST /tokenize), in OpenAI's shapes."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

_ROLES = {"system", "developer", "user", "assistant", "tool"}

_TEXT_PARTS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    },
}
_CONTENT = {"anyOf": [{"type": "string"}, _TEXT_PARTS]}
_MESSAGE_TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            "required": ["name"],
        },
    },
    "required": ["function"],
}
# One schema per role; an assistant message that calls tools may have no content.
_MESSAGE = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT},
            "required": ["role", "content"],
        },
        {
            "type": "object",
            "properties": {"role": {"const": "assistant"}, "content": _CONTENT},
            "required": ["role", "content"],
        },
        {
            "type": "object",
            "properties": {
                "role": {"const": "assistant"},
                "content": {"anyOf": [_CONTENT, {"type": "null"}]},
                "tool_calls": {"type": "array", "items": _MESSAGE_TOOL_CALL, "minItems": 1},
            },
            "required": ["role", "tool_calls"],
        },
        {
            "type": "object",
            "properties": {
                "role": {"const": "tool"},
                "content": _CONTENT,
                "tool_call_id": {"type": "string", "minLength": 1},
            },
            "required": ["role", "content", "tool_call_id"],
        },
    ]
}
MESSAGES_SCHEMA = {"type": "array", "items": _MESSAGE, "minItems": 1}


@extend_schema_field(MESSAGES_SCHEMA)
class MessagesField(serializers.Field):
    """`messages`: role + text content (a string or a list of text parts); assistant messages may
    carry `tool_calls` (then content may be null), `tool` messages a `tool_call_id`. Internal value:
    [{"role", "content": str, "tool_calls"?: [...], "tool_call_id"?: str}], with `developer` read
    as `system` (as OpenAI does for older models)."""

    def to_internal_value(self, data: Any) -> list[dict[str, Any]]:
        if not isinstance(data, list) or not data:
            raise serializers.ValidationError("messages must be a non-empty list.")
        out: list[dict[str, Any]] = []
        for i, message in enumerate(data):
            if not isinstance(message, dict):
                raise serializers.ValidationError(f"messages[{i}] must be an object.")
            role = message.get("role")
            if "function_call" in message:
                raise serializers.ValidationError(
                    f"messages[{i}].function_call is not supported; use tool_calls."
                )
            # A role that is not a string (an object, a list) is no role, not a crash of `in`.
            if not isinstance(role, str) or role not in _ROLES:
                raise serializers.ValidationError(
                    f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}."
                )
            calls = message.get("tool_calls")
            if calls is not None and role != "assistant":
                raise serializers.ValidationError(f"messages[{i}]: only assistant messages have tool_calls.")
            item: dict[str, Any] = {"role": "system" if role == "developer" else role}
            if calls:
                item["tool_calls"] = _tool_calls(calls, i)
                item["content"] = "" if message.get("content") is None else _text(message, i)
            else:
                item["content"] = _text(message, i)
            if role == "tool":
                call_id = message.get("tool_call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise serializers.ValidationError(
                        f"messages[{i}].tool_call_id must be a non-empty string."
                    )
                item["tool_call_id"] = call_id
            out.append(item)
        return out

    def to_representation(self, value: Any) -> Any:
        return value


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise serializers.ValidationError(f"messages[{i}].tool_calls must be a list.")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str)
        ):
            raise serializers.ValidationError(
                f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}"
                " with arguments as a JSON string."
            )
        out.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": function.get("arguments") or "{}"},
            }
        )
    return out


def _text(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise serializers.ValidationError(f"messages[{i}].content: only text parts are supported.")
            parts.append(part["text"])
        return "".join(parts)
    raise serializers.ValidationError(f"messages[{i}].content must be a string or a list of text parts.")
