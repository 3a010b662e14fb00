"""The Responses API's shapes, for the OpenAPI schema only (the translator reads the bodies and the
renderer writes the answers, which these must describe)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from engine.rules import SERVICE_TIERS

_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_INPUT_ITEM = {
    "type": "object",
    "description": (
        "A message (role and content: a string or input_text/output_text parts), a function_call "
        "(call_id, name, arguments) or a function_call_output (call_id, output); reasoning items "
        "are accepted and left out of the prompt."
    ),
    "properties": {
        "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "id": {"type": "string"},
        "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
        "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    },
}
_OUTPUT_ITEM = {
    "type": "object",
    "description": "A reasoning item, an assistant message with output_text parts, or a function_call.",
    "properties": {
        "type": {"enum": ["reasoning", "message", "function_call"]},
        "id": {"type": "string"},
        "status": {"enum": ["in_progress", "completed", "incomplete"]},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object"}},
        "summary": {"type": "array", "items": {"type": "object"}},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
    },
    "required": ["type", "id"],
}


@extend_schema_field({"anyOf": [{"type": "string"}, {"type": "array", "items": _INPUT_ITEM}]})
class ResponseInputField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "type": "array",
        "items": {
            "type": "object",
            "description": (
                "A function tool: {type: function, name, description, parameters, strict}. Hosted "
                "tools (web_search, file_search, code_interpreter, mcp, custom, ...) are accepted and "
                "left out of the prompt: this server does not run them."
            ),
            "properties": {
                "type": {"type": "string"},
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "strict": {"type": "boolean"},
            },
            "required": ["type"],
        },
    }
)
class ResponseToolsField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "anyOf": [
            {"enum": ["auto", "none", "required"]},
            {
                "type": "object",
                "properties": {
                    "type": {"enum": ["function", "allowed_tools"]},
                    "name": {"type": "string"},
                    "mode": {"enum": ["auto", "required"]},
                    "tools": {"type": "array", "items": {"type": "object"}},
                },
                "required": ["type"],
            },
        ]
    }
)
class ResponseToolChoiceField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "type": "object",
        "properties": {
            "format": {
                "type": "object",
                "description": "text (default), json_object, or json_schema with name, schema and strict.",
                "properties": {
                    "type": {"enum": ["text", "json_object", "json_schema"]},
                    "name": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": "boolean"},
                },
                "required": ["type"],
            },
            "verbosity": {"enum": ["low", "medium", "high"]},
        },
    }
)
class ResponseTextField(serializers.JSONField):
    pass


@extend_schema_serializer(component_name="CreateResponse")
class ResponseCreateInputSerializer(serializers.Serializer):
    """The body of POST /v1/responses, OpenAI's fields."""

    model = serializers.CharField()
    input = ResponseInputField(required=False)
    instructions = serializers.CharField(required=False, allow_null=True)
    previous_response_id = serializers.CharField(required=False, allow_null=True)
    store = serializers.BooleanField(required=False, help_text="Keep the response (default true).")
    max_output_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=2)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=1)
    stream = serializers.BooleanField(required=False)
    tools = ResponseToolsField(required=False)
    tool_choice = ResponseToolChoiceField(required=False)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)
    text = ResponseTextField(required=False)
    reasoning = serializers.DictField(required=False, allow_null=True, help_text="Accepted.")
    include = serializers.ListField(child=serializers.CharField(), required=False, allow_null=True)
    metadata = serializers.DictField(child=serializers.CharField(), required=False, allow_null=True)
    user = serializers.CharField(required=False, allow_null=True, max_length=64)
    safety_identifier = serializers.CharField(required=False, allow_null=True, max_length=64)
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, max_length=64)
    service_tier = serializers.ChoiceField(choices=SERVICE_TIERS, required=False, allow_null=True)
    truncation = serializers.ChoiceField(choices=["disabled"], required=False, allow_null=True)
    background = serializers.BooleanField(required=False, help_text="Only false.")


class ResponseUsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField(min_value=0)
    input_tokens_details = serializers.DictField(child=serializers.IntegerField(min_value=0))
    output_tokens = serializers.IntegerField(min_value=0)
    output_tokens_details = serializers.DictField(child=serializers.IntegerField(min_value=0))
    total_tokens = serializers.IntegerField(min_value=0)


@extend_schema_field({"type": "array", "items": _OUTPUT_ITEM})
class OutputItemsField(serializers.JSONField):
    pass


@extend_schema_serializer(component_name="Response")
class ResponseObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["response"])
    created_at = serializers.IntegerField()
    status = serializers.ChoiceField(choices=["completed", "incomplete", "failed", "in_progress"])
    error = serializers.DictField(allow_null=True)
    incomplete_details = serializers.DictField(allow_null=True)
    model = serializers.CharField()
    output = OutputItemsField()
    previous_response_id = serializers.CharField(allow_null=True)
    store = serializers.BooleanField()
    usage = ResponseUsageSerializer(allow_null=True)


@extend_schema_serializer(component_name="ResponseDeleted")
class ResponseDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["response"])
    deleted = serializers.BooleanField()


@extend_schema_field({"type": "array", "items": _INPUT_ITEM})
class InputItemsField(serializers.JSONField):
    pass


@extend_schema_serializer(component_name="ResponseInputItemList")
class InputItemListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = InputItemsField()
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


# Before OpenAPI 3.2 (itemSchema), the schema of a text/event-stream describes one event.
RESPONSE_EVENTS = OpenApiResponse(
    {
        "type": "object",
        "description": "One server-sent event.",
        "properties": {
            "event": {
                "enum": [
                    "response.created",
                    "response.in_progress",
                    "response.output_item.added",
                    "response.content_part.added",
                    "response.output_text.delta",
                    "response.output_text.done",
                    "response.reasoning_text.delta",
                    "response.reasoning_text.done",
                    "response.content_part.done",
                    "response.function_call_arguments.delta",
                    "response.function_call_arguments.done",
                    "response.output_item.done",
                    "response.completed",
                    "response.incomplete",
                    "error",
                    "response.failed",
                ]
            },
            "data": {
                "type": "string",
                "description": "The event as JSON: its `type` (the event's name) and `sequence_number`.",
            },
        },
        "required": ["event", "data"],
    },
    description="With `stream: true`: the Responses events, response.created to response.completed.",
)
