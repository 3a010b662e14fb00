"""The completions body (the parser's serializer) and the response's shape (for the OpenAPI
schema: the renderer builds the bodies, which it must describe)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from engine.rules import MAX_LOGPROBS, MAX_SEQUENCES_PER_REQUEST
from inference.api.fields import PromptField, SamplingInputSerializer
from inference.api.responses import CompletionBaseSerializer, PromptLogprobsField, constant


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
    object = constant("text_completion")
    choices = CompletionChoiceSerializer(many=True)
