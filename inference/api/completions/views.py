"""The view of POST /v1/completions."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from drf_spectacular.utils import extend_schema

from core.api.openapi import api_errors
from inference.api.base import GenerationApi
from inference.api.completions.render import CompletionStream, text_completion_body
from inference.api.completions.schema import CompletionInputSerializer, CompletionSerializer
from inference.api.responses import EVENT_STREAM


class CompletionCreateApi(GenerationApi):
    kind = "completion"
    Stream = CompletionStream
    InputSerializer = CompletionInputSerializer

    @extend_schema(
        operation_id="createCompletion",
        summary="Create a text completion",
        request=CompletionInputSerializer,
        responses={
            (200, "application/json"): CompletionSerializer,
            (200, "text/event-stream"): EVENT_STREAM,
            **api_errors(400, 404, 413),
        },
    )
    async def post(self, request: HttpRequest):
        return await super().post(request)

    def response_body(self, plan, choices, usage) -> dict[str, Any]:
        return text_completion_body(plan, choices, usage)
