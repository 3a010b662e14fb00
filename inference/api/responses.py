"""The generation endpoints' response shapes as serializers, for the OpenAPI schema only: the bodies
themselves are built by `formatting` (and `chat_output`, `sse`), which these must describe."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema_field
from rest_framework import serializers

from engine.rules import SERVICE_TIERS


def _constant(value: str) -> serializers.ChoiceField:
    return serializers.ChoiceField(choices=[value])


class PromptTokensDetailsSerializer(serializers.Serializer):
    cached_tokens = serializers.IntegerField(min_value=0)


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField(min_value=0)
    completion_tokens = serializers.IntegerField(min_value=0)
    total_tokens = serializers.IntegerField(min_value=0)
    prompt_tokens_details = PromptTokensDetailsSerializer()


class TopLogprobSerializer(serializers.Serializer):
    token = serializers.CharField(allow_blank=True)
    logprob = serializers.FloatField()
    bytes = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=255))


class TokenLogprobSerializer(TopLogprobSerializer):
    top_logprobs = TopLogprobSerializer(many=True)


class ChatLogprobsSerializer(serializers.Serializer):
    content = TokenLogprobSerializer(many=True)
    refusal = serializers.CharField(allow_null=True)


class ToolCallFunctionSerializer(serializers.Serializer):
    name = serializers.CharField()
    arguments = serializers.CharField(allow_blank=True, help_text="The arguments, as JSON text.")


class ToolCallSerializer(serializers.Serializer):
    id = serializers.CharField()
    type = _constant("function")
    function = ToolCallFunctionSerializer()


class ChatMessageSerializer(serializers.Serializer):
    role = _constant("assistant")
    content = serializers.CharField(allow_null=True, allow_blank=True)
    refusal = serializers.CharField(allow_null=True)
    tool_calls = ToolCallSerializer(many=True, required=False)


# vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: its entry}.
@extend_schema_field(
    {
        "type": "array",
        "items": {
            "type": ["object", "null"],
            "additionalProperties": {
                "type": "object",
                "properties": {
                    "logprob": {"type": "number"},
                    "rank": {"type": "integer"},
                    "decoded_token": {"type": "string"},
                },
                "required": ["logprob", "rank", "decoded_token"],
            },
        },
    }
)
class PromptLogprobsField(serializers.Field):
    pass


class ChatChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0)
    message = ChatMessageSerializer()
    logprobs = ChatLogprobsSerializer(allow_null=True)
    finish_reason = serializers.ChoiceField(choices=["stop", "length", "tool_calls"])


class CompletionBaseSerializer(serializers.Serializer):
    id = serializers.CharField()
    created = serializers.IntegerField()
    model = serializers.CharField()
    system_fingerprint = serializers.CharField(allow_null=True)
    service_tier = serializers.ChoiceField(choices=SERVICE_TIERS[1:], help_text="The tier it ran on.")
    usage = UsageSerializer()


class ChatCompletionSerializer(CompletionBaseSerializer):
    object = _constant("chat.completion")
    choices = ChatChoiceSerializer(many=True)
    prompt_logprobs = PromptLogprobsField(required=False, allow_null=True)


class CompletionLogprobsSerializer(serializers.Serializer):
    """Legacy logprobs: per token its text, logprob, top alternatives and text offset (an echoed
    prompt's first token has no logprob)."""

    tokens = serializers.ListField(child=serializers.CharField(allow_blank=True))
    token_logprobs = serializers.ListField(child=serializers.FloatField(allow_null=True))
    top_logprobs = serializers.ListField(
        child=serializers.DictField(child=serializers.FloatField(), allow_null=True)
    )
    text_offset = serializers.ListField(child=serializers.IntegerField(min_value=0))


class CompletionChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0)
    text = serializers.CharField(allow_blank=True)
    logprobs = CompletionLogprobsSerializer(allow_null=True)
    finish_reason = serializers.ChoiceField(choices=["stop", "length"])
    prompt_logprobs = PromptLogprobsField(required=False, allow_null=True)


class CompletionSerializer(CompletionBaseSerializer):
    object = _constant("text_completion")
    choices = CompletionChoiceSerializer(many=True)


# Before OpenAPI 3.2 (itemSchema), the schema of a text/event-stream describes one event.
EVENT_STREAM = OpenApiResponse(
    {
        "type": "object",
        "description": "One server-sent event.",
        "properties": {
            "data": {
                "type": "string",
                "description": (
                    "A chunk in OpenAI's shape (chat.completion.chunk, or text_completion for "
                    'completions) as JSON; after a failure, {"error": {...}} in the API\'s error shape; '
                    "last, [DONE]."
                ),
            }
        },
        "required": ["data"],
    },
    description="With `stream: true`: server-sent events, one chunk each, then `data: [DONE]`.",
)
