"""The OpenAPI description of /v1/files and /v1/batches: OpenAI's objects, field for field."""

from __future__ import annotations

from rest_framework import serializers


class FileObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    bytes = serializers.IntegerField()
    created_at = serializers.IntegerField()
    expires_at = serializers.IntegerField(allow_null=True)
    filename = serializers.CharField()
    purpose = serializers.ChoiceField(choices=["batch", "batch_output"])
    status = serializers.CharField()
    status_details = serializers.CharField(allow_null=True)


class FileListSerializer(serializers.Serializer):
    object = serializers.CharField()
    data = FileObjectSerializer(many=True)
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()


class FileDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    deleted = serializers.BooleanField()


class FileUploadSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="JSONL: one request per line")
    purpose = serializers.ChoiceField(choices=["batch"])


class RequestCountsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()


class BatchObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    endpoint = serializers.CharField()
    errors = serializers.JSONField(allow_null=True)
    input_file_id = serializers.CharField()
    completion_window = serializers.CharField()
    status = serializers.CharField()
    output_file_id = serializers.CharField(allow_null=True)
    error_file_id = serializers.CharField(allow_null=True)
    created_at = serializers.IntegerField()
    in_progress_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField()
    finalizing_at = serializers.IntegerField(allow_null=True)
    completed_at = serializers.IntegerField(allow_null=True)
    failed_at = serializers.IntegerField(allow_null=True)
    expired_at = serializers.IntegerField(allow_null=True)
    cancelling_at = serializers.IntegerField(allow_null=True)
    cancelled_at = serializers.IntegerField(allow_null=True)
    request_counts = RequestCountsSerializer()
    metadata = serializers.DictField(child=serializers.CharField(), allow_null=True)


class BatchListSerializer(serializers.Serializer):
    object = serializers.CharField()
    data = BatchObjectSerializer(many=True)
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()
