"""Adapter pages of the tenant dashboard. Reads through selectors, writes through services."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from core.errors import InvalidRequestError
from inference.forms import AdapterUploadForm
from inference.selectors import adapter_get_for_tenant, adapter_list_for_tenant, deployment_names_enabled
from inference.services.adapters import adapter_delete_for_member, adapter_upload_for_member
from tenants.dashboard.access import TenantAccess, tenant_page

# Form fields the upload service's errors are shown under (its `param`); others go on top.
_FORM_FIELDS = {"name": "name", "base_model": "base_model", "file": "files"}


def _base_models(access: TenantAccess) -> list[str]:
    allowed = list(getattr(getattr(access.tenant, "limits", None), "allowed_models", None) or [])
    return deployment_names_enabled(names=allowed)


def _page(
    request: HttpRequest, access: TenantAccess, form: AdapterUploadForm, status: int = 200
) -> HttpResponse:
    adapters = list(adapter_list_for_tenant(tenant_id=access.tenant.pk))
    context = access.context(
        active_tab="adapters",
        form=form,
        adapters=adapters,
        can_manage_adapters=access.can_manage,
        pending=any(a.status in ("uploaded", "validating") for a in adapters),
    )
    return render(request, "dashboard/adapters.html", context, status=status)


@require_GET
@tenant_page
def adapters(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    return _page(request, access, AdapterUploadForm(base_models=_base_models(access)))


@require_POST
@tenant_page
def adapter_create(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    access.require_manager(what="adapters")
    base_models = _base_models(access)
    form = AdapterUploadForm(request.POST, request.FILES, base_models=base_models)
    if not form.is_valid():
        return _page(request, access, form, status=400)
    try:
        adapter = adapter_upload_for_member(
            user=request.user,
            tenant=access.tenant,
            name=form.cleaned_data["name"],
            base_model=form.cleaned_data["base_model"],
            files=form.cleaned_data["files"],
            allowed_models=base_models,
        )
    except InvalidRequestError as exc:
        form.add_error(_FORM_FIELDS.get(exc.param or ""), exc.message)
        return _page(request, access, form, status=400)
    messages.success(request, f"Adapter “{adapter.name}” was uploaded; it is being validated.")
    return redirect("adapters:adapters", slug=access.tenant.slug)


@require_http_methods(["GET", "POST"])
@tenant_page
def adapter_remove(request: HttpRequest, access: TenantAccess, name: str) -> HttpResponse:
    adapter = adapter_get_for_tenant(tenant_id=access.tenant.pk, name=name)
    access.require_manager(what="adapters")
    if request.method == "GET":
        context = access.context(active_tab="adapters", adapter=adapter)
        return render(request, "dashboard/adapter_delete_confirm.html", context)
    adapter_delete_for_member(user=request.user, tenant_id=access.tenant.pk, name=adapter.name)
    messages.success(request, f"Adapter “{adapter.name}” was deleted.")
    return redirect("adapters:adapters", slug=access.tenant.slug)
