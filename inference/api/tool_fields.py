"""Chat completion fields for structured output and tools, in OpenAI's shapes: `response_format`,
`tools` and `tool_choice`."""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from engine.structured_output.spec import MAX_SPEC_CHARS, spec_key
from inference.tool_parsers import required_tools_schema

# OpenAI's rules for function and schema names, and its limit on tools per request.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
_NAME_SCHEMA = {"type": "string", "pattern": _NAME.pattern}


def _spec_size_check(spec: dict[str, Any], what: str) -> None:
    """The bound structured_outputs has (MAX_SPEC_CHARS, measured on the canonical spec the grammar
    is built and cached from), so that no field reaches a grammar build with a bigger one."""
    if len(spec_key(spec)) > MAX_SPEC_CHARS:
        raise serializers.ValidationError(
            f"{what} may be at most {MAX_SPEC_CHARS} characters as compact JSON."
        )


def _tools_size_check(tools: list[dict[str, Any]]) -> None:
    """The tools as given (descriptions included), and the grammar a required tool_choice builds
    from them (every tool's parameters, the largest a tool_choice can ask for), are each bounded by
    MAX_SPEC_CHARS: what the engine accepts as a structured output spec."""
    if len(spec_key({"tools": tools})) > MAX_SPEC_CHARS:
        raise serializers.ValidationError(
            f"tools may be at most {MAX_SPEC_CHARS} characters as compact JSON."
        )
    required = {"json": required_tools_schema(tools, parallel=False), "disable_any_whitespace": True}
    if len(spec_key(required)) > MAX_SPEC_CHARS:
        raise serializers.ValidationError(
            f"The grammar of these tools would be over {MAX_SPEC_CHARS} characters; send fewer or smaller"
            " parameter schemas."
        )


@extend_schema_field(
    {
        "anyOf": [
            {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]},
            {"type": "object", "properties": {"type": {"const": "json_object"}}, "required": ["type"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "properties": {
                            "name": _NAME_SCHEMA,
                            "description": {"type": "string"},
                            "schema": {"type": "object"},
                            "strict": {"type": ["boolean", "null"]},
                        },
                        "required": ["name"],
                    },
                },
                "required": ["type", "json_schema"],
            },
        ]
    }
)
class ResponseFormatField(serializers.Field):
    """`response_format`: text, json_object, or json_schema {name, schema, strict?, description?}.
    Internal value: the structured output spec it asks for, or None for text."""

    def to_internal_value(self, data: Any) -> dict[str, Any] | None:
        if not isinstance(data, dict):
            raise serializers.ValidationError("response_format must be an object.")
        kind = data.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True, "disable_any_whitespace": True}
        if kind != "json_schema":
            raise serializers.ValidationError(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}."
            )
        spec = data.get("json_schema")
        if not isinstance(spec, dict):
            raise serializers.ValidationError("response_format.json_schema must be an object.")
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise serializers.ValidationError(
                "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -."
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise serializers.ValidationError(
                "response_format.json_schema.schema must be a JSON schema object."
            )
        if not isinstance(spec.get("strict", False), bool | None):
            raise serializers.ValidationError("response_format.json_schema.strict must be a boolean.")
        # strict or not, the grammar enforces the schema (and writes no properties beyond it).
        out = {"json": schema or {"type": "object"}, "disable_any_whitespace": True}
        _spec_size_check(out, "response_format.json_schema.schema")
        return out

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(
    {
        "type": "array",
        "maxItems": MAX_TOOLS,
        "items": {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "properties": {
                        "name": _NAME_SCHEMA,
                        "description": {"type": ["string", "null"]},
                        "parameters": {"type": ["object", "null"]},
                        "strict": {"type": ["boolean", "null"]},
                    },
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
    }
)
class ToolsField(serializers.Field):
    """`tools`: function tools {"type": "function", "function": {name, description?, parameters?,
    strict?}}. Internal value: the list as given, checked."""

    def to_internal_value(self, data: Any) -> list[dict[str, Any]]:
        if not isinstance(data, list):
            raise serializers.ValidationError("tools must be a list.")
        if len(data) > MAX_TOOLS:
            raise serializers.ValidationError(f"tools takes at most {MAX_TOOLS} tools.")
        names: set[str] = set()
        out = []
        for i, tool in enumerate(data):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
                raise serializers.ValidationError(
                    f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}."
                )
            name = function.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise serializers.ValidationError(
                    f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -."
                )
            if name in names:
                raise serializers.ValidationError(f"tools[{i}]: the function name {name!r} is used twice.")
            names.add(name)
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise serializers.ValidationError(
                    f"tools[{i}].function.parameters must be a JSON schema object."
                )
            if not isinstance(function.get("description", ""), str | None):
                raise serializers.ValidationError(f"tools[{i}].function.description must be a string.")
            clean = {"name": name}
            if function.get("description"):
                clean["description"] = function["description"]
            if parameters is not None:
                clean["parameters"] = parameters
            out.append({"type": "function", "function": clean})
        _tools_size_check(out)
        return out

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(
    {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}},
                        "required": ["name"],
                    },
                },
                "required": ["type", "function"],
            },
        ]
    }
)
class ToolChoiceField(serializers.JSONField):
    """`tool_choice`, checked against the tools by `tool_choice_check`."""


def tool_choice_check(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """`tool_choice` as none, auto, required or {"type": "function", "function": {"name"}} naming
    one of the tools; absent: auto with tools, none without (OpenAI's defaults)."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise serializers.ValidationError({"tool_choice": f"tool_choice {value!r} needs tools."})
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(function, dict):
        raise serializers.ValidationError(
            {
                "tool_choice": "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name'}}."
            }
        )
    name = function.get("name")
    if not any(t["function"]["name"] == name for t in tools):
        raise serializers.ValidationError(
            {"tool_choice": f"tool_choice names {name!r}, which is not in tools."}
        )
    return {"type": "function", "function": {"name": name}}
