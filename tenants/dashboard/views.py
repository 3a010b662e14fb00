"""Dashboard pages. Reads go through selectors, writes through tenants services; no logic here."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from core.errors import InvalidRequestError, NotFoundError
from tenants.audit_csv import audit_csv_response
from tenants.dashboard.access import TenantAccess, memberships_for_user, tenant_page
from tenants.dashboard.forms import AlertSettingsForm, ApiKeyCreateForm, ApiKeyRotateForm
from tenants.dashboard.usage import PERIOD_CHOICES, period_days, usage_report
from tenants.models import ApiKey
from tenants.selectors import (
    alert_list_for_tenant,
    api_key_get_for_user,
    api_key_list_for_tenant,
    audit_list_for_tenant,
    quota_status,
    quota_used_this_month,
    tenant_get_for_user,
)
from tenants.services import api_key_create_for_member, api_key_revoke_for_member, api_key_rotate_for_member
from tenants.services.alerts import alert_settings_get, alert_settings_update
from tenants.usage_csv import usage_csv, usage_csv_filename

WEBSOCKET_CHAT_PATH = "/ws/v1/chat"


@require_GET
@login_required
def home(request: HttpRequest) -> HttpResponse:
    memberships = memberships_for_user(user=request.user)
    if not memberships:
        return render(request, "dashboard/no_tenant.html", status=403)
    return redirect("dashboard:overview", slug=memberships[0].tenant.slug)


@require_GET
@login_required
def switch(request: HttpRequest) -> HttpResponse:
    slug = request.GET.get("tenant", "")
    if not slug:
        return redirect("dashboard:home")
    # Resolved through the user's memberships before any URL is built from it: anything else,
    # a string that is not a slug included, is a 404.
    try:
        tenant = tenant_get_for_user(user=request.user, slug=slug)
    except NotFoundError as exc:
        raise Http404(exc.message) from exc
    return redirect("dashboard:overview", slug=tenant.slug)


def _limits(access: TenantAccess):
    return getattr(access.tenant, "limits", None)


@require_GET
@tenant_page
def overview(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    status = quota_status(tenant=access.tenant)
    percent = None
    if status.quota:
        percent = min(100, round(100 * status.used / status.quota))
    elif status.quota == 0:
        percent = 100
    limits = _limits(access)
    quota = {
        "limit": status.quota,
        "used": status.used,
        "remaining": status.remaining,
        "percent": percent,
        "period_label": timezone.now().strftime("%B %Y"),
    }
    context = access.context(
        active_tab="overview",
        limits=limits,
        quota=quota,
        allowed_models=list(getattr(limits, "allowed_models", None) or []),
        active_key_count=api_key_list_for_tenant(tenant_id=access.tenant.pk)
        .filter(revoked_at__isnull=True)
        .count(),
    )
    return render(request, "dashboard/overview.html", context)


def _tenant_models(access: TenantAccess) -> list[str]:
    return [m for m in (getattr(_limits(access), "allowed_models", None) or []) if isinstance(m, str)]


def _keys_page(request: HttpRequest, access: TenantAccess, form: ApiKeyCreateForm, status: int = 200):
    context = access.context(
        active_tab="keys", form=form, keys=list(api_key_list_for_tenant(tenant_id=access.tenant.pk))
    )
    return render(request, "dashboard/keys.html", context, status=status)


@require_GET
@tenant_page
def keys(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    return _keys_page(request, access, ApiKeyCreateForm(tenant_models=_tenant_models(access)))


@require_POST
@tenant_page
def key_create(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    access.require_manager(what="API keys")
    form = ApiKeyCreateForm(request.POST, tenant_models=_tenant_models(access))
    if not form.is_valid():
        return _keys_page(request, access, form, status=400)
    api_key, secret = api_key_create_for_member(
        user=request.user,
        tenant_id=access.tenant.pk,
        name=form.cleaned_data["name"],
        expires_at=form.expires_at(),
        scope=form.cleaned_data["scope"],
        allowed_models=form.allowed_models(),
        requests_per_minute=form.cleaned_data["requests_per_minute"],
        tokens_per_minute=form.cleaned_data["tokens_per_minute"],
        monthly_token_budget=form.cleaned_data["monthly_token_budget"],
    )
    return _secret_page(request, access, api_key, secret, rotated=False)


def _secret_page(request: HttpRequest, access: TenantAccess, api_key: ApiKey, secret: str, *, rotated: bool):
    # The secret exists only in this response: it must not be kept by any cache or the back button.
    context = access.context(active_tab="keys", key=api_key, secret=secret, rotated=rotated)
    response = render(request, "dashboard/key_created.html", context)
    add_never_cache_headers(response)
    return response


def _tenant_key(request: HttpRequest, access: TenantAccess, key_id: int) -> ApiKey:
    api_key = api_key_get_for_user(user=request.user, api_key_id=key_id)
    # A user in two tenants must not reach tenant B's key through tenant A's URLs either.
    if api_key.tenant_id != access.tenant.pk:
        raise Http404("Not found.")
    return api_key


@require_GET
@tenant_page
def key_detail(request: HttpRequest, access: TenantAccess, key_id: int) -> HttpResponse:
    api_key = _tenant_key(request, access, key_id)
    return _key_detail_page(request, access, api_key, ApiKeyRotateForm())


def _key_detail_page(
    request: HttpRequest, access: TenantAccess, api_key: ApiKey, form: ApiKeyRotateForm, status: int = 200
) -> HttpResponse:
    context = access.context(
        active_tab="keys",
        key=api_key,
        rotate_form=form,
        previous_left=_time_left(api_key.previous_valid_until),
        budget_used=quota_used_this_month(tenant_id=access.tenant.pk, api_key_id=api_key.pk)
        if api_key.monthly_token_budget is not None
        else None,
    )
    return render(request, "dashboard/key_detail.html", context, status=status)


def _time_left(until) -> str | None:
    """How long until `until`, as "5 h 12 min" (None once it passed)."""
    if until is None or until <= timezone.now():
        return None
    minutes = int((until - timezone.now()).total_seconds() // 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"


@require_POST
@tenant_page
def key_rotate(request: HttpRequest, access: TenantAccess, key_id: int) -> HttpResponse:
    api_key = _tenant_key(request, access, key_id)
    access.require_manager(what="API keys")
    form = ApiKeyRotateForm(request.POST)
    if not form.is_valid():
        return _key_detail_page(request, access, api_key, form, status=400)
    try:
        api_key, secret = api_key_rotate_for_member(
            user=request.user, api_key_id=api_key.pk, grace=form.grace()
        )
    except InvalidRequestError as exc:
        form.add_error(None, exc.message)
        return _key_detail_page(request, access, api_key, form, status=400)
    return _secret_page(request, access, api_key, secret, rotated=True)


@require_http_methods(["GET", "POST"])
@tenant_page
def key_revoke(request: HttpRequest, access: TenantAccess, key_id: int) -> HttpResponse:
    api_key = _tenant_key(request, access, key_id)
    access.require_manager(what="API keys")
    if request.method == "GET":
        return render(
            request, "dashboard/key_revoke_confirm.html", access.context(active_tab="keys", key=api_key)
        )
    api_key_revoke_for_member(user=request.user, api_key_id=api_key.pk)
    messages.success(request, f"Key “{api_key.name}” ({api_key.display_prefix}…) was revoked.")
    return redirect("dashboard:keys", slug=access.tenant.slug)


@require_GET
@tenant_page
def usage(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    days = period_days(request.GET.get("days"))
    report = usage_report(tenant_id=access.tenant.pk, days=days, today=timezone.now().date())
    context = access.context(
        active_tab="usage",
        period_days=days,
        period_choices=PERIOD_CHOICES,
        start=report.start,
        end=report.end,
        daily=report.daily,
        by_model=report.by_model,
        totals=report.totals,
        chart_daily=report.chart_daily(),
        chart_models=report.chart_models(),
    )
    return render(request, "dashboard/usage.html", context)


@require_GET
@tenant_page
def usage_export(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    """The usage page's period as CSV: a row per day, model and key."""
    days = period_days(request.GET.get("days"))
    end = timezone.now().date()
    start = end - timedelta(days=days - 1)
    response = HttpResponse(
        usage_csv(tenant_id=access.tenant.pk, start=start, end=end), content_type="text/csv; charset=utf-8"
    )
    filename = usage_csv_filename(tenant_slug=access.tenant.slug, start=start, end=end)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


@require_GET
@tenant_page
def playground(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    models = list(getattr(_limits(access), "allowed_models", None) or [])
    context = access.context(active_tab="playground", models=models, ws_path=WEBSOCKET_CHAT_PATH)
    return render(request, "dashboard/playground.html", context)


AUDIT_PAGE_SIZE = 50


@require_GET
@tenant_page
def audit(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    """The tenant's audit log, newest first (owners and admins)."""
    access.require_manager(what="the audit log")
    page = Paginator(audit_list_for_tenant(tenant_id=access.tenant.pk), AUDIT_PAGE_SIZE).get_page(
        request.GET.get("page")
    )
    return render(request, "dashboard/audit.html", access.context(active_tab="audit", page=page))


@require_GET
@tenant_page
def audit_export(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    access.require_manager(what="the audit log")
    entries = audit_list_for_tenant(tenant_id=access.tenant.pk).order_by("created_at", "id")
    return audit_csv_response(entries, filename=f"audit-{access.tenant.slug}.csv")


ALERTS_SHOWN = 50


def _alerts_page(request: HttpRequest, access: TenantAccess, form: AlertSettingsForm, status: int = 200):
    row = alert_settings_get(tenant=access.tenant)
    context = access.context(
        active_tab="alerts",
        form=form,
        settings_row=row,
        alerts=alert_list_for_tenant(tenant_id=access.tenant.pk)[:ALERTS_SHOWN],
    )
    return render(request, "dashboard/alerts.html", context, status=status)


@require_http_methods(["GET", "POST"])
@tenant_page
def alerts(request: HttpRequest, access: TenantAccess) -> HttpResponse:
    """Alert thresholds, e-mail and the signed webhook; what fired, and each webhook's deliveries."""
    access.require_manager(what="alerts")
    row = alert_settings_get(tenant=access.tenant)
    if request.method == "GET":
        initial = {
            "thresholds": ", ".join(str(t) for t in row.thresholds),
            "email": row.email,
            "webhook_url": row.webhook_url,
            "rate_limit_hits": row.rate_limit_hits,
        }
        return _alerts_page(request, access, AlertSettingsForm(initial=initial))
    form = AlertSettingsForm(request.POST)
    if not form.is_valid():
        return _alerts_page(request, access, form, status=400)
    try:
        alert_settings_update(
            tenant=access.tenant,
            thresholds=form.cleaned_data["thresholds"],
            email=form.cleaned_data["email"],
            webhook_url=form.cleaned_data["webhook_url"] or "",
            rate_limit_hits=form.cleaned_data["rate_limit_hits"],
            new_secret=bool(request.POST.get("new_secret")),
        )
    except InvalidRequestError as exc:
        form.add_error(exc.param if exc.param in form.fields else None, exc.message)
        return _alerts_page(request, access, form, status=400)
    messages.success(request, "Alert settings saved.")
    return redirect("dashboard:alerts", slug=access.tenant.slug)
