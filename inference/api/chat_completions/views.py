"""The view of POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from drf_spectacular.utils import extend_schema

from core.api.openapi import api_errors
from inference.api.base import GenerationApi
from inference.api.chat_completions.render import ChatStream, chat_completion_body
from inference.api.chat_completions.schema import ChatCompletionInputSerializer, ChatCompletionSerializer
from inference.api.responses import EVENT_STREAM


class ChatCompletionCreateApi(GenerationApi):
    kind = "chat"
    Stream = ChatStream
    InputSerializer = ChatCompletionInputSerializer

    @extend_schema(
        operation_id="createChatCompletion",
        summary="Create a chat completion",
        request=ChatCompletionInputSerializer,
        responses={
            (200, "application/json"): ChatCompletionSerializer,
            (200, "text/event-stream"): EVENT_STREAM,
            **api_errors(400, 404, 413),
        },
    )
    async def post(self, request: HttpRequest):
        return await super().post(request)

    def response_body(self, plan, choices, usage) -> dict[str, Any]:
        return chat_completion_body(plan, choices, usage)
