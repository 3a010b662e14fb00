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

# What the platform itself passes to a chat template: a tenant's variables may not replace them.
_TEMPLATE_OWN = {
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "chat_template",
    "return_dict",
    "return_assistant_tokens_mask",
}
MAX_TEMPLATE_KWARGS = 16


class ChatTemplateKwargsField(serializers.DictField):
    """vLLM's `chat_template_kwargs`: variables for the model's chat template, such as Qwen3's
    `enable_thinking`. Values are booleans, numbers or null: a string could carry text the template
    would place in the prompt unchecked, where message text is kept from becoming control tokens."""

    def to_internal_value(self, data):
        values = super().to_internal_value(data)
        if len(values) > MAX_TEMPLATE_KWARGS:
            raise serializers.ValidationError(f"At most {MAX_TEMPLATE_KWARGS} chat template variables.")
        for key, value in values.items():
            if not key.isidentifier() or key in _TEMPLATE_OWN or key.endswith("_token"):
                raise serializers.ValidationError(f"`{key}` cannot be set as a chat template variable.")
            if value is not None and not isinstance(value, bool | int | float):
                raise serializers.ValidationError(
                    f"`{key}` must be a boolean, a number or null (chat template variables take no text)."
                )
        return values


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
    chat_template_kwargs = ChatTemplateKwargsField(required=False, allow_null=True)

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
    reasoning_content = serializers.CharField(
        allow_null=True,
        required=False,
        help_text="The model's thinking before its answer, where the model's deployment has a reasoning parser.",
    )


class ChatChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0)
    message = ChatMessageSerializer()
    logprobs = ChatLogprobsSerializer(allow_null=True)
    finish_reason = serializers.ChoiceField(choices=["stop", "length", "tool_calls"])


class ChatCompletionSerializer(CompletionBaseSerializer):
    object = constant("chat.completion")
    choices = ChatChoiceSerializer(many=True)
    prompt_logprobs = PromptLogprobsField(required=False, allow_null=True)
