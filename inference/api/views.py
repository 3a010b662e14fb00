"""The /v1 models API. The generation APIs are one package per wire format
(inference.api.chat_completions, inference.api.completions)."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers

from core.api.base import ApiView
from core.api.openapi import api_errors, list_of
from inference.api import formatting
from inference.selectors import adapter_list_servable, deployment_list_for_caller
from inference.services import served_model_resolve


@extend_schema_serializer(component_name="Model")
class ModelOutputSerializer(serializers.Serializer):
    """A base model, or one of the organization's adapters (with its base model as `parent`)."""

    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["model"])
    created = serializers.IntegerField()
    owned_by = serializers.CharField()
    parent = serializers.CharField(required=False)


class ModelListApi(ApiView):
    @extend_schema(
        operation_id="listModels",
        summary="List the models the key may use",
        responses={200: list_of("ModelList", ModelOutputSerializer), **api_errors()},
    )
    async def get(self, request: HttpRequest) -> dict[str, Any]:
        deployments = await sync_to_async(deployment_list_for_caller)(auth=self.auth)
        adapters = await sync_to_async(adapter_list_servable)(auth=self.auth)
        slug = self.auth.tenant_slug
        data = [formatting.model_object(deployment=d, tenant_slug=slug) for d in deployments] + [
            formatting.model_object(deployment=a.base_model, adapter=a, tenant_slug=slug) for a in adapters
        ]
        if request.headers.get("anthropic-version"):
            return formatting.anthropic_model_list(data)  # the anthropic SDK's models.list()
        return {"object": "list", "data": data}


class ModelRetrieveApi(ApiView):
    """One model as GET /v1/models lists it; another tenant's adapter is model_not_found, exactly
    as a name that does not exist."""

    @extend_schema(
        operation_id="retrieveModel",
        summary="Retrieve a model",
        parameters=[OpenApiParameter("model", str, OpenApiParameter.PATH, description="The model's id.")],
        responses={200: ModelOutputSerializer, **api_errors(404)},
    )
    async def get(self, request: HttpRequest, model: str) -> dict[str, Any]:
        served = await sync_to_async(served_model_resolve)(auth=self.auth, model=model)
        return formatting.model_object(
            deployment=served.deployment, adapter=served.adapter, tenant_slug=self.auth.tenant_slug
        )
