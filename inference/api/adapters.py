"""/v1/adapters: a tenant's LoRA adapters, uploaded as multipart (PEFT files or one zip).

The caller's key decides the tenant; another tenant's adapter is 404 adapter_not_found, exactly
as one that does not exist.
"""

from __future__ import annotations

from django.conf import settings
from django.http import JsonResponse
from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from core.api.base import ApiView, StrictSerializer, validated
from core.api.openapi import api_errors, list_of
from core.errors import InvalidRequestError
from inference.models import LoraAdapter
from inference.selectors import adapter_get_for_tenant, adapter_list_for_tenant
from inference.services.adapter_files import adapter_too_large
from inference.services.adapters import adapter_delete, adapter_upload
from tenants.models import Tenant
from tenants.services import tenant_allowed_models

# Room for the multipart framing and the form fields around the files.
_MULTIPART_OVERHEAD = 64 * 1024


@extend_schema_serializer(component_name="Adapter")
class AdapterOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="name")
    object = serializers.SerializerMethodField()
    created = serializers.SerializerMethodField()
    base_model = serializers.CharField(source="base_model.name")
    status = serializers.ChoiceField(choices=LoraAdapter.Status.choices)
    failure_reason = serializers.SerializerMethodField()
    version = serializers.CharField()
    rank = serializers.IntegerField(allow_null=True)
    lora_alpha = serializers.FloatField(source="alpha", allow_null=True)
    target_modules = serializers.ListField(child=serializers.CharField())
    bytes = serializers.IntegerField(source="size_bytes")

    @extend_schema_field({"type": "string", "enum": ["adapter"]})
    def get_object(self, adapter: LoraAdapter) -> str:
        return "adapter"

    def get_created(self, adapter: LoraAdapter) -> int:
        return int(adapter.created_at.timestamp())

    def get_failure_reason(self, adapter: LoraAdapter) -> str | None:
        return adapter.failure_reason or None


class AdapterListCreateApi(ApiView):
    """GET: the caller's tenant's adapters. POST: upload (or re-upload) one; validation follows."""

    required_scope = "manage"

    @extend_schema_serializer(component_name="CreateAdapter")
    class InputSerializer(StrictSerializer):
        """The multipart form of an upload: the adapter's name, its base model and its files."""

        name = serializers.CharField(max_length=200)
        base_model = serializers.CharField(max_length=200)
        file = serializers.ListField(child=serializers.FileField(allow_empty_file=True), allow_empty=False)

    @extend_schema(
        operation_id="listAdapters",
        summary="List the organization's LoRA adapters",
        responses={200: list_of("AdapterList", AdapterOutputSerializer), **api_errors()},
    )
    def get(self, request):
        adapters = adapter_list_for_tenant(tenant_id=self.auth.tenant_id)
        return {"object": "list", "data": AdapterOutputSerializer(adapters, many=True).data}

    @extend_schema(
        operation_id="createAdapter",
        summary="Upload a LoRA adapter",
        description=(
            "PEFT files (adapter_config.json and adapter_model.safetensors) or one zip of them, as "
            "`file` parts. The adapter is validated afterwards: its `status` says when it can serve."
        ),
        request={"multipart/form-data": InputSerializer},
        responses={201: AdapterOutputSerializer, **api_errors(400, 413)},
    )
    def post(self, request):
        # Refused before the multipart body is parsed into files; the stored size is checked again.
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        if declared > settings.ADAPTER_MAX_BYTES + _MULTIPART_OVERHEAD:
            raise adapter_too_large(settings.ADAPTER_MAX_BYTES)
        if request.content_type != "multipart/form-data":
            raise InvalidRequestError(
                "Upload adapters as multipart/form-data (fields name, base_model and file).",
                code="unsupported_media_type",
            )
        fields = {key: request.POST.get(key) for key in request.POST if key != "file"}
        data = validated(self.InputSerializer, {**fields, "file": request.FILES.getlist("file")})
        adapter = adapter_upload(
            tenant=Tenant.objects.get(pk=self.auth.tenant_id),
            name=data["name"],
            base_model=data["base_model"],
            files=data["file"],
            allowed_models=tenant_allowed_models(auth=self.auth),
        )
        return JsonResponse(AdapterOutputSerializer(adapter).data, status=201)


class AdapterDetailApi(ApiView):
    required_scope = "manage"

    @extend_schema_serializer(component_name="AdapterDeleted")
    class DeletedOutputSerializer(serializers.Serializer):
        id = serializers.CharField()
        object = serializers.ChoiceField(choices=["adapter"])
        deleted = serializers.BooleanField()

    @extend_schema(
        operation_id="retrieveAdapter",
        summary="Retrieve a LoRA adapter",
        responses={200: AdapterOutputSerializer, **api_errors(404)},
    )
    def get(self, request, name: str):
        adapter = adapter_get_for_tenant(tenant_id=self.auth.tenant_id, name=name)
        return AdapterOutputSerializer(adapter).data

    @extend_schema(
        operation_id="deleteAdapter",
        summary="Delete a LoRA adapter",
        responses={200: DeletedOutputSerializer, **api_errors(404)},
    )
    def delete(self, request, name: str):
        adapter_delete(tenant_id=self.auth.tenant_id, name=name)
        return {"id": name, "object": "adapter", "deleted": True}
