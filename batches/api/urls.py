from __future__ import annotations

from django.urls import path

from batches.api.views import (
    BatchCancelApi,
    BatchDetailApi,
    BatchListCreateApi,
    FileContentApi,
    FileDetailApi,
    FileListCreateApi,
)

urlpatterns = [
    path("files", FileListCreateApi.as_view(), name="v1-files"),
    path("files/<str:file_id>", FileDetailApi.as_view(), name="v1-file-detail"),
    path("files/<str:file_id>/content", FileContentApi.as_view(), name="v1-file-content"),
    path("batches", BatchListCreateApi.as_view(), name="v1-batches"),
    path("batches/<str:batch_id>", BatchDetailApi.as_view(), name="v1-batch-detail"),
    path("batches/<str:batch_id>/cancel", BatchCancelApi.as_view(), name="v1-batch-cancel"),
]
