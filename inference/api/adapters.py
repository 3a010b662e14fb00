"""/v1/adapters: a tenant's LoRA adapters, uploaded as multipart (PEFT files or one zip).

The caller's key decides the tenant; another tenant's adapter is 404 adapter_not_found, exactly
as one that does not exist.
"""

from __future__ import annotations

from django.conf import settings
from rest_framework import serializers, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response

from inference.models import LoraAdapter
from inference.selectors import adapter_get_for_tenant, adapter_list_for_tenant
from inference.services.adapter_files import adapter_too_large
from inference.services.adapters import adapter_delete, adapter_upload
from tenants.api.base import StrictSerializer, TenantApiView
from tenants.models import Tenant
from tenants.services import tenant_allowed_models

# Room for the multipart framing and the form fields around the files.
_MULTIPART_OVERHEAD = 64 * 1024


class AdapterOutputSerializer(serializers.Serializer):
    id = serializers.CharField(source="name")
    object = serializers.SerializerMethodField()
    created = serializers.SerializerMethodField()
    base_model = serializers.CharField(source="base_model.name")
    status = serializers.CharField()
    failure_reason = serializers.SerializerMethodField()
    version = serializers.CharField()
    rank = serializers.IntegerField(allow_null=True)
    lora_alpha = serializers.FloatField(source="alpha", allow_null=True)
    target_modules = serializers.ListField(child=serializers.CharField())
    bytes = serializers.IntegerField(source="size_bytes")

    def get_object(self, adapter: LoraAdapter) -> str:
        return "adapter"

    def get_created(self, adapter: LoraAdapter) -> int:
        return int(adapter.created_at.timestamp())

    def get_failure_reason(self, adapter: LoraAdapter) -> str | None:
        return adapter.failure_reason or None


class AdapterListCreateApi(TenantApiView):
    """GET: the caller's tenant's adapters. POST: upload (or re-upload) one; validation follows."""

    parser_classes = [MultiPartParser]

    class InputSerializer(StrictSerializer):
        name = serializers.CharField(max_length=200)
        base_model = serializers.CharField(max_length=200)
        file = serializers.ListField(child=serializers.FileField(allow_empty_file=True), allow_empty=False)

    def get(self, request):
        adapters = adapter_list_for_tenant(tenant_id=request.auth.tenant_id)
        return Response({"object": "list", "data": AdapterOutputSerializer(adapters, many=True).data})

    def post(self, request):
        # Refused before the multipart body is parsed into files; the stored size is checked again.
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        if declared > settings.ADAPTER_MAX_BYTES + _MULTIPART_OVERHEAD:
            raise adapter_too_large(settings.ADAPTER_MAX_BYTES)
        fields = {key: request.data.get(key) for key in request.data if key != "file"}
        serializer = self.InputSerializer(data={**fields, "file": request.FILES.getlist("file")})
        serializer.is_valid(raise_exception=True)
        adapter = adapter_upload(
            tenant=Tenant.objects.get(pk=request.auth.tenant_id),
            name=serializer.validated_data["name"],
            base_model=serializer.validated_data["base_model"],
            files=serializer.validated_data["file"],
            allowed_models=tenant_allowed_models(auth=request.auth),
        )
        return Response(AdapterOutputSerializer(adapter).data, status=status.HTTP_201_CREATED)


class AdapterDetailApi(TenantApiView):
    def get(self, request, name: str):
        adapter = adapter_get_for_tenant(tenant_id=request.auth.tenant_id, name=name)
        return Response(AdapterOutputSerializer(adapter).data)

    def delete(self, request, name: str):
        adapter_delete(tenant_id=request.auth.tenant_id, name=name)
        return Response({"id": name, "object": "adapter", "deleted": True})
