"""The OpenAI-compatible /v1 API: one view per operation, input serializers nested in each."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from rest_framework import serializers

from core.errors import PlatformError
from core.request_ids import new_request_id
from engine.rules import MAX_LOGPROBS
from inference.api import formatting
from inference.api.auth import authenticate_header
from inference.api.base import ApiView, GenerationApi, error_json
from inference.api.fields import MessagesField, PromptField, SamplingInputSerializer
from inference.selectors import adapter_list_servable, deployment_list_for_caller
from inference.services import chat_plan_create, completion_plan_create


class ModelListApi(ApiView):
    async def get(self, request: HttpRequest) -> JsonResponse:
        request_id = new_request_id()
        try:
            auth = await authenticate_header(request.headers.get("Authorization"))
            deployments = await sync_to_async(deployment_list_for_caller)(auth=auth)
            adapters = await sync_to_async(adapter_list_servable)(auth=auth)
        except PlatformError as exc:
            return error_json(exc, request_id)
        data = [
            {"id": d.name, "object": "model", "created": int(d.created_at.timestamp()), "owned_by": "pagoda"}
            for d in deployments
        ] + [
            # As vLLM lists LoRA modules: the adapter by name, its base model as parent.
            {
                "id": a.name,
                "object": "model",
                "created": int(a.created_at.timestamp()),
                "owned_by": auth.tenant_slug,
                "parent": a.base_model.name,
            }
            for a in adapters
        ]
        response = JsonResponse({"object": "list", "data": data})
        response["x-request-id"] = request_id
        return response


class ChatCompletionCreateApi(GenerationApi):
    class InputSerializer(SamplingInputSerializer):
        messages = MessagesField()
        max_completion_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
        logprobs = serializers.BooleanField(required=False, allow_null=True, default=False)
        top_logprobs = serializers.IntegerField(
            required=False, allow_null=True, min_value=0, max_value=MAX_LOGPROBS
        )
        response_format = serializers.DictField(required=False, allow_null=True)

        def validate_response_format(self, value: dict | None) -> dict | None:
            if value is not None and value.get("type") != "text":
                raise serializers.ValidationError("Only response_format {'type': 'text'} is supported.")
            return value

        def validate(self, attrs: dict) -> dict:
            attrs = super().validate(attrs)
            if attrs.get("top_logprobs") is not None and not attrs.get("logprobs"):
                raise serializers.ValidationError(
                    {"top_logprobs": "top_logprobs requires logprobs to be true."}
                )
            return attrs

    def plan_create(self, **kwargs: Any):
        return chat_plan_create(**kwargs)

    def response_body(self, plan, choices, usage) -> dict[str, Any]:
        return formatting.chat_completion_body(plan, choices, usage)


class CompletionCreateApi(GenerationApi):
    class InputSerializer(SamplingInputSerializer):
        prompt = PromptField()
        logprobs = serializers.IntegerField(
            required=False, allow_null=True, min_value=0, max_value=MAX_LOGPROBS
        )
        echo = serializers.BooleanField(required=False, allow_null=True)
        best_of = serializers.IntegerField(required=False, allow_null=True, min_value=1)

        def validate_echo(self, value: bool | None) -> bool | None:
            if value:
                raise serializers.ValidationError("echo is not supported.")
            return value

        def validate(self, attrs: dict) -> dict:
            attrs = super().validate(attrs)
            best_of = attrs.get("best_of")
            if best_of is not None and best_of != (attrs.get("n") or 1):
                raise serializers.ValidationError({"best_of": "best_of other than n is not supported."})
            return attrs

    def plan_create(self, **kwargs: Any):
        return completion_plan_create(**kwargs)

    def response_body(self, plan, choices, usage) -> dict[str, Any]:
        return formatting.text_completion_body(plan, choices, usage)
