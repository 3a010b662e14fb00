"""/v1/files and /v1/batches in OpenAI's shapes. Every lookup is the caller's tenant's: another
tenant's file or batch is a 404, as one that does not exist."""

from __future__ import annotations

from typing import Any

from django.http import FileResponse, HttpRequest
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers

from batches import services
from batches.api.schema import (
    BatchListSerializer,
    BatchObjectSerializer,
    FileDeletedSerializer,
    FileListSerializer,
    FileObjectSerializer,
    FileUploadSerializer,
)
from batches.models import Batch, File
from core.api.base import ApiView, StrictSerializer, json_body, validated
from core.api.openapi import api_errors
from core.errors import InvalidRequestError, NotFoundError

MAX_METADATA_PAIRS = 16


def _ts(value) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_object(file: File) -> dict[str, Any]:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": _ts(file.created_at),
        "expires_at": None,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(batch: Batch) -> dict[str, Any]:
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": batch.errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": _ts(batch.created_at),
        "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at),
        "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at),
        "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at),
        "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata,
    }


def _page(queryset, *, after: str | None, limit: int, render) -> dict[str, Any]:
    """A cursor page, newest first: the objects after the one named `after`."""
    if after:
        anchor = queryset.filter(id=after).first()
        if anchor is None:
            raise InvalidRequestError(f"No such object to list after: {after}", param="after")
        queryset = queryset.filter(created_at__lte=anchor.created_at).exclude(
            created_at=anchor.created_at, id__gte=anchor.id
        )
    rows = list(queryset.order_by("-created_at", "-id")[: limit + 1])
    data = [render(row) for row in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(rows) > limit,
    }


class ListQuerySerializer(StrictSerializer):
    after = serializers.CharField(required=False, max_length=64)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=10_000, default=20)
    purpose = serializers.CharField(required=False, max_length=32)
    order = serializers.ChoiceField(choices=["desc"], required=False)


class FileListCreateApi(ApiView):
    required_scope = "manage"
    handler_in_pool = True  # a multipart upload is read and counted in a thread of the pool

    @extend_schema(
        operation_id="createFile",
        request={"multipart/form-data": FileUploadSerializer},
        summary="Upload a batch input file",
        responses={200: FileObjectSerializer, **api_errors(400, 413)},
    )
    def post(self, request: HttpRequest) -> dict[str, Any]:
        if not (request.content_type or "").startswith("multipart/form-data"):
            raise InvalidRequestError(
                "Upload a file as multipart/form-data with fields `file` and `purpose`."
            )
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidRequestError("The `file` field is required.", param="file")
        purpose = request.POST.get("purpose")
        if not purpose:
            raise InvalidRequestError("The `purpose` field is required.", param="purpose")
        file = services.file_create(
            tenant_id=self.auth.tenant_id, upload=upload, filename=upload.name or "", purpose=purpose
        )
        return file_object(file)

    @extend_schema(
        operation_id="listFiles",
        summary="List files",
        parameters=[ListQuerySerializer],
        responses={200: FileListSerializer, **api_errors(400)},
    )
    def get(self, request: HttpRequest) -> dict[str, Any]:
        query = validated(ListQuerySerializer, request.GET.dict())
        files = File.objects.filter(tenant_id=self.auth.tenant_id)
        if query.get("purpose"):
            files = files.filter(purpose=query["purpose"])
        return _page(files, after=query.get("after"), limit=query["limit"], render=file_object)


class FileDetailApi(ApiView):
    required_scope = "manage"

    @extend_schema(
        operation_id="retrieveFile",
        summary="Retrieve a file",
        responses={200: FileObjectSerializer, **api_errors(404)},
    )
    def get(self, request: HttpRequest, file_id: str) -> dict[str, Any]:
        return file_object(services.file_get(tenant_id=self.auth.tenant_id, file_id=file_id))

    @extend_schema(
        operation_id="deleteFile",
        summary="Delete a file",
        responses={200: FileDeletedSerializer, **api_errors(404)},
    )
    def delete(self, request: HttpRequest, file_id: str) -> dict[str, Any]:
        file = services.file_delete(tenant_id=self.auth.tenant_id, file_id=file_id)
        return {"id": file.id, "object": "file", "deleted": True}


class FileContentApi(ApiView):
    required_scope = "manage"

    @extend_schema(
        operation_id="downloadFile",
        summary="A file's content",
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, **api_errors(404)},
    )
    def get(self, request: HttpRequest, file_id: str) -> FileResponse:
        file = services.file_get(tenant_id=self.auth.tenant_id, file_id=file_id)
        try:
            stream = file.content.open("rb")
        except FileNotFoundError as exc:
            raise NotFoundError(f"The content of {file_id} is gone.", code="file_not_found") from exc
        return FileResponse(stream, content_type="application/octet-stream", filename=file.filename)


class BatchCreateSerializer(StrictSerializer):
    input_file_id = serializers.CharField(max_length=64)
    endpoint = serializers.CharField(max_length=64)
    completion_window = serializers.CharField(max_length=8)
    metadata = serializers.DictField(
        child=serializers.CharField(max_length=512, allow_blank=True), required=False, allow_null=True
    )

    def validate_metadata(self, value: dict | None) -> dict | None:
        if value and (len(value) > MAX_METADATA_PAIRS or any(len(k) > 64 for k in value)):
            raise serializers.ValidationError(
                "metadata holds at most 16 pairs, with keys of at most 64 characters."
            )
        return value


class BatchListCreateApi(ApiView):
    required_scope = "manage"

    @extend_schema(
        operation_id="createBatch",
        summary="Create a batch",
        request=BatchCreateSerializer,
        responses={200: BatchObjectSerializer, **api_errors(400, 404)},
    )
    def post(self, request: HttpRequest) -> dict[str, Any]:
        data = validated(BatchCreateSerializer, json_body(request))
        batch = services.batch_create(
            tenant_id=self.auth.tenant_id,
            api_key_id=self.auth.api_key_id,
            input_file_id=data["input_file_id"],
            endpoint=data["endpoint"],
            completion_window=data["completion_window"],
            metadata=data.get("metadata"),
        )
        return batch_object(batch)

    @extend_schema(
        operation_id="listBatches",
        parameters=[ListQuerySerializer],
        summary="List batches",
        responses={200: BatchListSerializer, **api_errors(400)},
    )
    def get(self, request: HttpRequest) -> dict[str, Any]:
        query = validated(ListQuerySerializer, request.GET.dict())
        batches = Batch.objects.filter(tenant_id=self.auth.tenant_id)
        return _page(batches, after=query.get("after"), limit=min(query["limit"], 100), render=batch_object)


class BatchDetailApi(ApiView):
    required_scope = "manage"

    @extend_schema(
        operation_id="retrieveBatch",
        summary="Retrieve a batch",
        responses={200: BatchObjectSerializer, **api_errors(404)},
    )
    def get(self, request: HttpRequest, batch_id: str) -> dict[str, Any]:
        return batch_object(services.batch_get(tenant_id=self.auth.tenant_id, batch_id=batch_id))


class BatchCancelApi(ApiView):
    required_scope = "manage"

    @extend_schema(
        operation_id="cancelBatch",
        request=None,
        summary="Cancel a batch",
        responses={200: BatchObjectSerializer, **api_errors(404)},
    )
    def post(self, request: HttpRequest, batch_id: str) -> dict[str, Any]:
        return batch_object(services.batch_cancel(tenant_id=self.auth.tenant_id, batch_id=batch_id))
