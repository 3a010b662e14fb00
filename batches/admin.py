"""Operators see every tenant's batches (status, progress, counts, files) and files, and may cancel
a batch."""

from __future__ import annotations

from django.contrib import admin, messages
from django.utils.html import format_html

from batches.models import Batch, File
from batches.services import batch_cancel


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "purpose", "filename", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    search_fields = ("id", "filename", "tenant__slug")
    readonly_fields = ("id", "tenant", "purpose", "filename", "bytes", "lines", "content", "created_at")

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "endpoint", "status", "progress", "completed", "failed", "created_at")
    list_filter = ("status", "endpoint")
    search_fields = ("id", "tenant__slug", "input_file_id")
    actions = ("cancel",)
    readonly_fields = [f.name for f in Batch._meta.fields] + ["progress"]

    def has_add_permission(self, request) -> bool:
        return False

    @admin.display(description="progress")
    def progress(self, obj: Batch) -> str:
        share = 100 * obj.done // obj.total if obj.total else 0
        return (
            format_html(
                '<progress max="{}" value="{}"></progress> {} / {}',
                obj.total or 1,
                obj.done,
                obj.done,
                obj.total,
            )
            if obj.total
            else f"{share}%"
        )

    @admin.action(description="Cancel the selected batches", permissions=["change"])
    def cancel(self, request, queryset) -> None:
        for batch in queryset:
            batch_cancel(tenant_id=batch.tenant_id, batch_id=batch.id)
        messages.success(request, f"{queryset.count()} batches asked to stop.")
