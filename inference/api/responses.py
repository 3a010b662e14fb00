"""What the generation endpoints' response shapes share, as serializers for the OpenAPI schema
only: usage, token logprobs, vLLM's prompt_logprobs, the fields of every completion object, and the
event stream. Each wire format's own shapes are in its package (inference.api.chat_completions,
inference.api.completions), beside the renderer they describe."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema_field
from rest_framework import serializers

from engine.rules import SERVICE_TIERS


def constant(value: str) -> serializers.ChoiceField:
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


class CompletionBaseSerializer(serializers.Serializer):
    id = serializers.CharField()
    created = serializers.IntegerField()
    model = serializers.CharField()
    system_fingerprint = serializers.CharField(allow_null=True)
    service_tier = serializers.ChoiceField(choices=SERVICE_TIERS[1:], help_text="The tier it ran on.")
    usage = UsageSerializer()


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
