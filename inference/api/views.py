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
from inference.services import served_model_resolve


class ModelListApi(ApiView):
    async def get(self, request: HttpRequest) -> dict[str, Any]:
        deployments = await sync_to_async(deployment_list_for_caller)(auth=self.auth)
        adapters = await sync_to_async(adapter_list_servable)(auth=self.auth)
        slug = self.auth.tenant_slug
        data = [formatting.model_object(deployment=d, tenant_slug=slug) for d in deployments] + [
            formatting.model_object(deployment=a.base_model, adapter=a, tenant_slug=slug) for a in adapters
        ]
        return {"object": "list", "data": data}


class ModelRetrieveApi(ApiView):
    """One model as GET /v1/models lists it; another tenant's adapter is model_not_found, exactly
    as a name that does not exist."""

    async def get(self, request: HttpRequest, model: str) -> dict[str, Any]:
        served = await sync_to_async(served_model_resolve)(auth=self.auth, model=model)
        return formatting.model_object(
            deployment=served.deployment, adapter=served.adapter, tenant_slug=self.auth.tenant_slug
        )


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
