"""POST /tokenize and POST /detokenize in vLLM's shapes, authenticated and rate-limited as /v1 is."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from core.api.base import ApiView, StrictSerializer, json_body, validated
from inference.api.fields import MessagesField, ModelField
from inference.services import prompt_tokenize, tokens_detokenize

# A body is bounded by DATA_UPLOAD_MAX_MEMORY_SIZE; token lists by this.
MAX_DETOKENIZE_TOKENS = 1_000_000


class TokenizeApi(ApiView):
    class InputSerializer(StrictSerializer):
        model = ModelField(max_length=200)
        prompt = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False)
        messages = MessagesField(required=False)
        add_special_tokens = serializers.BooleanField(required=False, default=True)
        add_generation_prompt = serializers.BooleanField(required=False, default=True)
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
    class InputSerializer(StrictSerializer):
        model = ModelField(max_length=200)
        tokens = serializers.ListField(
            child=serializers.IntegerField(min_value=0), max_length=MAX_DETOKENIZE_TOKENS
        )

    def post(self, request) -> dict[str, Any]:
        data = validated(self.InputSerializer, json_body(request))
        return {"prompt": tokens_detokenize(auth=self.auth, model=data["model"], tokens=data["tokens"])}
