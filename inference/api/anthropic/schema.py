"""The Messages API's shapes, for the OpenAPI schema only (the translator reads the bodies and the
renderer writes the answers, which these must describe)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from engine.rules import MAX_STOP_STRINGS

_TEXT_BLOCK = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_BLOCK = {
    "type": "object",
    "description": "A content block: text, tool_use (assistant) or tool_result (user).",
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result"]},
        "text": {"type": "string"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
        "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
        "is_error": {"type": "boolean"},
    },
    "required": ["type"],
}


@extend_schema_field(
    {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "properties": {
                "role": {"enum": ["user", "assistant"]},
                "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
            },
            "required": ["role", "content"],
        },
    }
)
class TurnsField(serializers.JSONField):
    pass


@extend_schema_field({"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]})
class SystemField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "input_schema": {"type": "object"},
            },
            "required": ["name", "input_schema"],
        },
    }
)
class MessageToolsField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "type": "object",
        "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]},
            "name": {"type": "string"},
            "disable_parallel_tool_use": {"type": "boolean"},
        },
        "required": ["type"],
    }
)
class MessageToolChoiceField(serializers.JSONField):
    pass


@extend_schema_field(
    {
        "type": "object",
        "description": "format: a JSON schema the answer follows (structured outputs); effort is accepted.",
        "properties": {
            "effort": {"enum": ["low", "medium", "high", "xhigh", "max"]},
            "format": {
                "type": "object",
                "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}},
                "required": ["type", "schema"],
            },
        },
    }
)
class OutputConfigField(serializers.JSONField):
    pass


class MessagePromptInputSerializer(serializers.Serializer):
    model = serializers.CharField()
    messages = TurnsField()
    system = SystemField(required=False)
    tools = MessageToolsField(required=False)
    tool_choice = MessageToolChoiceField(required=False)
    thinking = serializers.JSONField(
        required=False, help_text='Only {"type": "disabled"}: extended thinking is not supported.'
    )


@extend_schema_serializer(component_name="CreateMessage")
class MessageCreateInputSerializer(MessagePromptInputSerializer):
    """The body of POST /v1/messages, Anthropic's fields."""

    max_tokens = serializers.IntegerField(min_value=1)
    stop_sequences = serializers.ListField(
        child=serializers.CharField(), required=False, max_length=MAX_STOP_STRINGS
    )
    temperature = serializers.FloatField(required=False, min_value=0, max_value=2)
    top_p = serializers.FloatField(required=False, min_value=0, max_value=1)
    top_k = serializers.IntegerField(required=False)
    metadata = serializers.DictField(required=False, help_text="`user_id` is recorded in the usage ledger.")
    output_config = OutputConfigField(required=False)
    stream = serializers.BooleanField(required=False)


@extend_schema_serializer(component_name="CountMessageTokens")
class MessageCountInputSerializer(MessagePromptInputSerializer):
    """The body of POST /v1/messages/count_tokens."""


class MessageUsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField(min_value=0)
    cache_creation_input_tokens = serializers.IntegerField(min_value=0)
    cache_read_input_tokens = serializers.IntegerField(min_value=0)
    output_tokens = serializers.IntegerField(min_value=0)


@extend_schema_field({"type": "array", "items": _BLOCK})
class ContentBlocksField(serializers.JSONField):
    pass


@extend_schema_serializer(component_name="Message")
class MessageSerializer(serializers.Serializer):
    id = serializers.CharField()
    type = serializers.ChoiceField(choices=["message"])
    role = serializers.ChoiceField(choices=["assistant"])
    model = serializers.CharField()
    content = ContentBlocksField()
    stop_reason = serializers.ChoiceField(choices=["end_turn", "max_tokens", "stop_sequence", "tool_use"])
    stop_sequence = serializers.CharField(allow_null=True)
    usage = MessageUsageSerializer()


@extend_schema_serializer(component_name="MessageTokensCount")
class MessageTokensCountSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField(min_value=0)


class AnthropicErrorDetailSerializer(serializers.Serializer):
    type = serializers.CharField()
    message = serializers.CharField()


@extend_schema_serializer(component_name="AnthropicError")
class AnthropicErrorSerializer(serializers.Serializer):
    """An error in Anthropic's shape."""

    type = serializers.ChoiceField(choices=["error"])
    error = AnthropicErrorDetailSerializer()


_ERRORS = {
    400: "The request is invalid.",
    401: "The API key is missing, malformed, unknown or revoked.",
    403: "The key's organization is not active.",
    404: "The model does not exist, or is not this organization's.",
    413: "The request body is larger than this server accepts.",
    429: "A limit was reached (see retry-after).",
    529: "The service is overloaded or unavailable (no engine, its queue or database); retry later.",
}


def anthropic_errors() -> dict[int, OpenApiResponse]:
    return {
        status: OpenApiResponse(AnthropicErrorSerializer, description=text)
        for status, text in _ERRORS.items()
    }


# Before OpenAPI 3.2 (itemSchema), the schema of a text/event-stream describes one event.
MESSAGE_EVENTS = OpenApiResponse(
    {
        "type": "object",
        "description": "One server-sent event.",
        "properties": {
            "event": {
                "enum": [
                    "message_start",
                    "ping",
                    "content_block_start",
                    "content_block_delta",
                    "content_block_stop",
                    "message_delta",
                    "message_stop",
                    "error",
                ]
            },
            "data": {
                "type": "string",
                "description": "The event's body as JSON (its `type` is the event's name).",
            },
        },
        "required": ["event", "data"],
    },
    description="With `stream: true`: Anthropic's server-sent events, message_start to message_stop.",
)
