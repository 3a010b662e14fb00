"""The chat completions body (the parser's serializer) and the response's shape (for the OpenAPI
schema: the renderer builds the bodies, which it must describe)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from engine.rules import MAX_LOGPROBS
from inference.api.fields import SamplingInputSerializer
from inference.api.message_fields import MessagesField
from inference.api.responses import (
    CompletionBaseSerializer,
    PromptLogprobsField,
    TokenLogprobSerializer,
    constant,
)
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


class ChatLogprobsSerializer(serializers.Serializer):
    content = TokenLogprobSerializer(many=True)
    refusal = serializers.CharField(allow_null=True)


class ToolCallFunctionSerializer(serializers.Serializer):
    name = serializers.CharField()
    arguments = serializers.CharField(allow_blank=True, help_text="The arguments, as JSON text.")


class ToolCallSerializer(serializers.Serializer):
    id = serializers.CharField()
    type = constant("function")
    function = ToolCallFunctionSerializer()


class ChatMessageSerializer(serializers.Serializer):
    role = constant("assistant")
    content = serializers.CharField(allow_null=True, allow_blank=True)
    refusal = serializers.CharField(allow_null=True)
    tool_calls = ToolCallSerializer(many=True, required=False)


class ChatChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0)
    message = ChatMessageSerializer()
    logprobs = ChatLogprobsSerializer(allow_null=True)
    finish_reason = serializers.ChoiceField(choices=["stop", "length", "tool_calls"])


class ChatCompletionSerializer(CompletionBaseSerializer):
    object = constant("chat.completion")
    choices = ChatChoiceSerializer(many=True)
    prompt_logprobs = PromptLogprobsField(required=False, allow_null=True)
