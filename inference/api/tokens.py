"""POST /tokenize and POST /detokenize in vLLM's shapes, authenticated and rate-limited as /v1 is."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers

from core.api.base import ApiView, StrictSerializer, json_body, validated
from core.api.openapi import api_errors
from inference.api.fields import ModelField
from inference.api.message_fields import MessagesField
from inference.services import prompt_tokenize, tokens_detokenize

# A body is bounded by DATA_UPLOAD_MAX_MEMORY_SIZE; token lists by this (the longest contexts served),
# and then by the model's context length.
MAX_DETOKENIZE_TOKENS = 131_072


class TokenIdsField(serializers.ListField):
    """A list of token ids whose length is checked before each id is: DRF checks max_length only
    after validating every element, a second of CPU for a million of them."""

    def to_internal_value(self, data):
        if isinstance(data, list) and self.max_length is not None and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
        return super().to_internal_value(data)


class TokenizeApi(ApiView):
    handler_in_pool = True

    @extend_schema_serializer(component_name="Tokenize")
    class InputSerializer(StrictSerializer):
        """The body of POST /tokenize: a prompt or a conversation."""

        model = ModelField(max_length=200)
        prompt = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False)
        messages = MessagesField(required=False)
        add_special_tokens = serializers.BooleanField(required=False, default=True)
        add_generation_prompt = serializers.BooleanField(
            required=False, default=True, help_text="Only true is supported."
        )
        return_token_strs = serializers.BooleanField(required=False, default=False)

        def validate_add_generation_prompt(self, value: bool) -> bool:
            if not value:
                raise serializers.ValidationError(
                    "Only add_generation_prompt true is supported: the prompt is rendered as "
                    "/v1/chat/completions renders it."
                )
            return value

        def validate_prompt(self, value: str) -> str:
            if not isinstance(self.initial_data.get("prompt"), str):
                raise serializers.ValidationError("prompt must be a string.")
            return value

        def validate(self, attrs: dict) -> dict:
            if ("prompt" in attrs) == ("messages" in attrs):
                raise serializers.ValidationError({"prompt": "Give either prompt or messages."})
            return attrs

    @extend_schema_serializer(component_name="TokenizeResponse")
    class OutputSerializer(serializers.Serializer):
        count = serializers.IntegerField(min_value=0)
        max_model_len = serializers.IntegerField(min_value=1)
        tokens = serializers.ListField(child=serializers.IntegerField(min_value=0))
        token_strs = serializers.ListField(child=serializers.CharField(allow_blank=True), allow_null=True)

    @extend_schema(
        operation_id="tokenize",
        summary="Tokenize a prompt or a conversation",
        description="Give either `prompt` or `messages` (rendered as /v1/chat/completions renders them).",
        request=InputSerializer,
        responses={200: OutputSerializer, **api_errors(400, 404, 413)},
    )
    def post(self, request) -> dict[str, Any]:
        data = validated(self.InputSerializer, json_body(request))
        result = prompt_tokenize(
            auth=self.auth,
            model=data["model"],
            prompt=data.get("prompt"),
            messages=data.get("messages"),
            add_special_tokens=data["add_special_tokens"],
            with_token_strs=data["return_token_strs"],
        )
        return {
            "count": len(result.tokens),
            "max_model_len": result.max_model_len,
            "tokens": result.tokens,
            "token_strs": result.token_strs,
        }


class DetokenizeApi(ApiView):
    handler_in_pool = True

    @extend_schema_serializer(component_name="Detokenize")
    class InputSerializer(StrictSerializer):
        """The body of POST /detokenize."""

        model = ModelField(max_length=200)
        tokens = TokenIdsField(child=serializers.IntegerField(min_value=0), max_length=MAX_DETOKENIZE_TOKENS)

    @extend_schema_serializer(component_name="DetokenizeResponse")
    class OutputSerializer(serializers.Serializer):
        prompt = serializers.CharField(allow_blank=True)

    @extend_schema(
        operation_id="detokenize",
        summary="Detokenize token ids",
        request=InputSerializer,
        responses={200: OutputSerializer, **api_errors(400, 404, 413)},
    )
    def post(self, request) -> dict[str, Any]:
        data = validated(self.InputSerializer, json_body(request))
        return {"prompt": tokens_detokenize(auth=self.auth, model=data["model"], tokens=data["tokens"])}
