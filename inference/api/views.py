"""The OpenAI-compatible /v1 API: one view per operation."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest

from core.api.base import ApiView
from inference.api import formatting
from inference.api.base import GenerationApi
from inference.api.serializers import ChatCompletionInputSerializer, CompletionInputSerializer
from inference.selectors import adapter_list_servable, deployment_list_for_caller


class ModelListApi(ApiView):
    async def get(self, request: HttpRequest) -> dict[str, Any]:
        deployments = await sync_to_async(deployment_list_for_caller)(auth=self.auth)
        adapters = await sync_to_async(adapter_list_servable)(auth=self.auth)
        data = [
            {"id": d.name, "object": "model", "created": int(d.created_at.timestamp()), "owned_by": "pagoda"}
            for d in deployments
        ] + [
            # As vLLM lists LoRA modules: the adapter by name, its base model as parent.
            {
                "id": a.name,
                "object": "model",
                "created": int(a.created_at.timestamp()),
                "owned_by": self.auth.tenant_slug,
                "parent": a.base_model.name,
            }
            for a in adapters
        ]
        return {"object": "list", "data": data}


class ChatCompletionCreateApi(GenerationApi):
    kind = "chat"
    InputSerializer = ChatCompletionInputSerializer

    def response_body(self, plan, choices, usage) -> dict[str, Any]:
        return formatting.chat_completion_body(plan, choices, usage)


class CompletionCreateApi(GenerationApi):
    kind = "completion"
    InputSerializer = CompletionInputSerializer

    def response_body(self, plan, choices, usage) -> dict[str, Any]:
        return formatting.text_completion_body(plan, choices, usage)
