"""The tenant dashboard's Batches page: each batch's status, progress, counts and its files to
download; owners and admins may cancel one. Another tenant's batch or file is a 404."""

from __future__ import annotations

from django.contrib import messages
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from batches import services
from batches.models import Batch
from core.errors import NotFoundError
from tenants.dashboard.access import TenantAccess, tenant_page

PAGE_SIZE = 50


@require_GET
@tenant_page
def batches(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    rows = list(Batch.objects.filter(tenant_id=access.tenant.pk).order_by("-created_at", "-id")[:PAGE_SIZE])
    context = access.context(
        active_tab="batches",
        batches=rows,
        can_cancel=access.can_manage,
        running=any(b.status in Batch.ACTIVE for b in rows),
    )
    return render(request, "dashboard/batches.html", context)


@require_POST
@tenant_page
def batch_cancel(request: HttpRequest, access: TenantAccess, batch_id: str) -> HttpResponse:
    access.require_manager(what="batches")
    try:
        batch = services.batch_cancel(tenant_id=access.tenant.pk, batch_id=batch_id)
    except NotFoundError as exc:
        raise Http404(exc.message) from exc
    messages.success(request, f"Batch {batch.id} is {batch.get_status_display().lower()}.")
    return redirect("batches:batches", slug=access.tenant.slug)


@require_GET
@tenant_page
def file_download(request: HttpRequest, access: TenantAccess, file_id: str) -> FileResponse:
    try:
        file = services.file_get(tenant_id=access.tenant.pk, file_id=file_id)
        stream = file.content.open("rb")
    except (NotFoundError, FileNotFoundError) as exc:
        raise Http404("No such file.") from exc
    return FileResponse(stream, as_attachment=True, filename=file.filename, content_type="application/jsonl")
