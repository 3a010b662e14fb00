"""Operator admin: tenants (limits and members inline), API keys (secret shown once after
creation, revoke action, never the digest), the usage ledger with a per-day chart, daily roll-ups."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin, messages
from django.db import models, transaction
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from core.errors import InvalidRequestError
from tenants.admin_audit import AuditedAdmin
from tenants.audit_csv import audit_csv_response
from tenants.models import (
    Alert,
    AlertSettings,
    ApiKey,
    AuditEntry,
    Membership,
    Tenant,
    TenantLimits,
    UsageDaily,
    UsageRecord,
    WebhookDelivery,
)
from tenants.selectors import usage_per_day
from tenants.services import api_key_create, api_key_revoke, api_key_rotate, auth_cache_invalidate

CHART_WIDTH, CHART_HEIGHT, CHART_MAX_DAYS = 720, 160, 62


class TenantLimitsInline(admin.StackedInline):
    model = TenantLimits
    can_delete = False
    max_num = 1
    min_num = 1

    def get_formset(self, request, obj=None, **kwargs):
        formset = super().get_formset(request, obj, **kwargs)
        # A new tenant's form starts at the default limits; emptied, a field means unlimited.
        for name, value in settings.TENANT_DEFAULT_LIMITS.items():
            formset.form.base_fields[name].initial = value
        return formset


class AlertSettingsInline(admin.StackedInline):
    model = AlertSettings
    can_delete = False
    max_num = 1
    fields = ("thresholds", "email", "webhook_url", "rate_limit_hits")
    # A webhook URL typed without a scheme is https.
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ("user",)
    fields = ("user", "role", "created_at")
    readonly_fields = ("created_at",)


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    list_display = ("name", "slug", "active", "created_at")
    list_filter = ("active",)
    search_fields = ("name", "slug")
    prepopulated_fields = {"slug": ("name",)}
    inlines = (TenantLimitsInline, MembershipInline, AlertSettingsInline)

    def save_related(self, request, form, formsets, change) -> None:
        super().save_related(request, form, formsets, change)
        # New limits or a deactivation must reach cached keys in every process.
        transaction.on_commit(auth_cache_invalidate)


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin):
    list_display = (
        "name",
        "display_prefix",
        "tenant",
        "created_by",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    )
    list_filter = ("tenant", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "prefix", "tenant__slug")
    list_select_related = ("tenant", "created_by")
    actions = ("revoke_selected", "rotate_selected")
    secret_template = "admin/tenants/apikey/secret_once.html"
    audit_additions = False  # api_key_create records the creation
    # The digest is on no form, list or page.
    exclude = ("digest",)
    _editable = (
        "name",
        "expires_at",
        "scope",
        "requests_per_minute",
        "tokens_per_minute",
        "monthly_token_budget",
        "allowed_models",
    )

    # Shown on a key's change page, never edited there.
    _shown = ("created_by", "created_at", "last_used_at", "previous_valid_until", "revoked_at")

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("tenant", *self._editable)
        return ("tenant", "display_prefix", *self._editable, *self._shown)

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        return ("tenant", "display_prefix", *self._shown)

    @admin.display(description="prefix")
    def display_prefix(self, obj: ApiKey) -> str:
        return obj.display_prefix

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # keys are revoked, not deleted: the ledger refers to them

    def save_model(self, request, obj: ApiKey, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            transaction.on_commit(auth_cache_invalidate)
            return
        created, raw_key = api_key_create(
            tenant=obj.tenant,
            name=obj.name,
            created_by=request.user,
            expires_at=obj.expires_at,
            requests_per_minute=obj.requests_per_minute,
            tokens_per_minute=obj.tokens_per_minute,
            allowed_models=obj.allowed_models,
            scope=obj.scope,
            monthly_token_budget=obj.monthly_token_budget,
        )
        # The admin continues with `obj` (log entry, redirect): make it the saved row.
        for field in ("pk", "prefix", "digest", "created_by_id", "created_at"):
            setattr(obj, field, getattr(created, field))
        obj._state.adding = False
        obj._state.db = created._state.db
        # Kept on this request only: the one response that shows it.
        request._new_api_key_secret = raw_key

    def response_add(self, request, obj: ApiKey, post_url_continue=None):
        raw_key = getattr(request, "_new_api_key_secret", None)
        if raw_key is None:
            return super().response_add(request, obj, post_url_continue)
        return self._secret_once(request, obj, raw_key, rotated=False)

    def _secret_once(self, request, api_key: ApiKey, raw_key: str, *, rotated: bool):
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "api_key": api_key,
            "raw_key": raw_key,
            "rotated": rotated,
            "title": "Copy the new API key now",
        }
        response = TemplateResponse(request, self.secret_template, context)
        add_never_cache_headers(response)
        return response

    @admin.action(
        description="Rotate the selected API key (the old secret stays valid 24 hours)",
        permissions=["change"],
    )
    def rotate_selected(self, request, queryset):
        if queryset.count() != 1:
            self.message_user(
                request, "Rotate one key at a time: its new secret is shown once.", messages.ERROR
            )
            return None
        try:
            api_key, raw_key = api_key_rotate(api_key=queryset.get())
        except InvalidRequestError as exc:
            self.message_user(request, exc.message, messages.ERROR)
            return None
        return self._secret_once(request, api_key, raw_key, rotated=True)

    @admin.action(description="Revoke selected API keys", permissions=["change"])
    def revoke_selected(self, request, queryset) -> None:
        revoked = 0
        for api_key in queryset.filter(revoked_at__isnull=True).order_by("pk"):
            api_key_revoke(api_key=api_key)
            revoked += 1
        self.message_user(request, f"Revoked {revoked} API key(s).", messages.SUCCESS)


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


def bar_chart(rows: list[dict], *, value: str) -> dict:
    """Bars (x, y, width, height in SVG units) for the last CHART_MAX_DAYS days of `rows`."""
    rows = rows[-CHART_MAX_DAYS:]
    peak = max((r[value] for r in rows), default=0) or 1
    slot = CHART_WIDTH / max(len(rows), 1)
    bars = []
    for index, row in enumerate(rows):
        height = round(row[value] / peak * (CHART_HEIGHT - 20), 1)
        bars.append(
            {
                "x": round(index * slot + slot * 0.1, 1),
                "y": round(CHART_HEIGHT - height, 1),
                "width": round(slot * 0.8, 1),
                "height": height,
                "label": f"{row['day'].isoformat()}: {row['requests']} requests, {row['tokens']} tokens",
            }
        )
    return {
        "bars": bars,
        "width": CHART_WIDTH,
        "height": CHART_HEIGHT,
        "peak": peak,
        "value": value,
        "first": rows[0]["day"] if rows else None,
        "last": rows[-1]["day"] if rows else None,
    }


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = (
        "request_id",
        "created_at",
        "tenant",
        "api_key",
        "model",
        "adapter",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "time_to_first_token_ms",
        "latency_ms",
        "status",
    )
    list_filter = ("tenant", "model", "status", "created_at")
    date_hierarchy = "created_at"
    search_fields = ("request_id",)
    list_select_related = ("tenant", "api_key")
    change_list_template = "admin/tenants/usagerecord/change_list.html"

    def changelist_view(self, request, extra_context=None):
        response = super().changelist_view(request, extra_context)
        context_data = getattr(response, "context_data", None)  # absent on redirects
        changelist = context_data.get("cl") if context_data else None
        if changelist is not None:
            # The chart follows the list's filters (tenant, model, day).
            rows = usage_per_day(records=changelist.queryset)
            response.context_data["usage_chart"] = bar_chart(rows, value="tokens")
        return response


@admin.register(UsageDaily)
class UsageDailyAdmin(ReadOnlyAdmin):
    list_display = (
        "day",
        "tenant",
        "api_key",
        "model",
        "adapter",
        "requests",
        "errors",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
    )
    list_filter = ("tenant", "model", "day")
    date_hierarchy = "day"
    list_select_related = ("tenant", "api_key")


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    """The audit log: every tenant's entries, read-only (nothing here can change or remove one)."""

    list_display = (
        "created_at",
        "tenant_slug",
        "actor",
        "source",
        "address",
        "action",
        "object_type",
        "object_repr",
    )
    list_filter = ("source", "action", "object_type", "tenant")
    search_fields = ("actor", "object_repr", "object_id", "tenant_slug")
    date_hierarchy = "created_at"
    actions = ("export_csv",)
    fields = (
        "created_at",
        "tenant",
        "tenant_slug",
        "source",
        "actor",
        "actor_user",
        "actor_api_key",
        "address",
        "action",
        "object_type",
        "object_id",
        "object_repr",
        "changes",
    )
    readonly_fields = fields

    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.is_staff and request.user.has_perm("tenants.view_auditentry")

    def has_export_permission(self, request) -> bool:
        return self.has_view_permission(request)

    @admin.action(description="Export selected entries as CSV", permissions=["export"])
    def export_csv(self, request, queryset):
        return audit_csv_response(queryset.order_by("created_at", "id"), filename="audit-log.csv")


class WebhookDeliveryInline(admin.TabularInline):
    model = WebhookDelivery
    extra = 0
    can_delete = False
    fields = ("url", "status", "attempts", "response_status", "error", "last_attempt_at")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    """Alerts that fired, with their webhook deliveries."""

    list_display = ("created_at", "tenant", "kind", "subject", "threshold", "period", "used", "limit")
    list_filter = ("kind", "tenant")
    list_select_related = ("tenant",)
    inlines = (WebhookDeliveryInline,)
