"""The bodies of the generation endpoints, validated the same way whichever transport carries
them (REST or the websocket)."""

from __future__ import annotations

import functools
from typing import Any

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from core.api.base import validated
from core.api.exceptions import to_platform_error
from core.errors import InvalidRequestError
from engine.rules import MAX_LOGPROBS, MAX_SEQUENCES_PER_REQUEST
from inference.api.fields import PromptField, SamplingInputSerializer, refuse_unsupported
from inference.api.message_fields import MessagesField
from inference.api.tool_fields import ResponseFormatField, ToolChoiceField, ToolsField, tool_choice_check


@extend_schema_serializer(component_name="CreateChatCompletion")
class ChatCompletionInputSerializer(SamplingInputSerializer):
    """The body of POST /v1/chat/completions: OpenAI's fields, and vLLM's extras."""

    messages = MessagesField()
    max_completion_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    logprobs = serializers.BooleanField(required=False, allow_null=True, default=False)
    top_logprobs = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=MAX_LOGPROBS
    )
    # Internal value: the structured output spec it asks for (None for text).
    response_format = ResponseFormatField(required=False, allow_null=True)
    tools = ToolsField(required=False, allow_null=True)
    tool_choice = ToolChoiceField(required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)

    def validate(self, attrs: dict) -> dict:
        attrs = super().validate(attrs)
        if attrs.get("top_logprobs") is not None and not attrs.get("logprobs"):
            raise serializers.ValidationError({"top_logprobs": "top_logprobs requires logprobs to be true."})
        if attrs.get("response_format") and attrs.get("structured_outputs"):
            raise serializers.ValidationError(
                {"structured_outputs": "Give either response_format or structured_outputs, not both."}
            )
        attrs["tool_choice"] = tool_choice_check(attrs.get("tool_choice"), attrs.get("tools") or [])
        if attrs["tool_choice"] not in ("none", "auto") and (
            attrs.get("response_format") or attrs.get("structured_outputs")
        ):
            raise serializers.ValidationError(
                {"tool_choice": "A required or named tool_choice cannot be combined with a response_format."}
            )
        return attrs


@extend_schema_serializer(component_name="CreateCompletion")
class CompletionInputSerializer(SamplingInputSerializer):
    """The body of POST /v1/completions: OpenAI's fields, and vLLM's extras."""

    prompt = PromptField()
    # 0 only with echo: the prompt (and its logprobs) without a completion.
    max_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    logprobs = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_LOGPROBS)
    echo = serializers.BooleanField(required=False, allow_null=True)
    best_of = serializers.IntegerField(required=False, allow_null=True, min_value=1)

    def validate(self, attrs: dict) -> dict:
        attrs = super().validate(attrs)
        best_of = attrs.get("best_of")
        if best_of is not None and best_of != (attrs.get("n") or 1):
            raise serializers.ValidationError({"best_of": "best_of other than n is not supported."})
        if attrs.get("max_tokens") == 0 and not attrs.get("echo"):
            raise serializers.ValidationError({"max_tokens": "max_tokens may be 0 only with echo."})
        if attrs.get("echo") and attrs.get("stream"):
            raise serializers.ValidationError(
                {"echo": "echo is not supported with stream; ask without streaming."}
            )
        if len(attrs["prompt"]) * (attrs.get("n") or 1) > MAX_SEQUENCES_PER_REQUEST:
            raise serializers.ValidationError(
                {"n": f"The number of prompts times n may be at most {MAX_SEQUENCES_PER_REQUEST}."}
            )
        return attrs


@functools.cache
def _field_names(serializer_class: type[serializers.Serializer]) -> frozenset[str]:
    # A serializer deep-copies its declared fields whenever one is made: once per class is enough.
    return frozenset(serializer_class().fields)


def generation_input(body: Any, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    """A generation body's validated data; the first unsupported, unknown or invalid field is an
    InvalidRequestError naming it."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        refuse_unsupported(body, _field_names(serializer_class))
    except serializers.ValidationError as exc:
        raise to_platform_error(exc) from exc
    return validated(serializer_class, body)
