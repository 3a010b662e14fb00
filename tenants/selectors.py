"""Tenancy reads. Everything a member may see is looked up through their membership, so an
outsider gets NotFoundError (404) for another tenant's objects, never a hint that they exist."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from django.db.models import Count, DecimalField, ExpressionWrapper, F, Q, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from core.errors import NotFoundError
from tenants.models import Alert, ApiKey, AuditEntry, Membership, Tenant, UsageRecord

GROUP_BY_CHOICES = ("day", "model", "key")


def membership_get(*, user, tenant_id: int) -> Membership:
    membership = (
        Membership.objects.select_related("tenant")
        .filter(user_id=getattr(user, "pk", None), tenant_id=tenant_id, tenant__active=True)
        .first()
    )
    if membership is None:
        raise NotFoundError("Not found.")
    return membership


def tenant_list_for_user(*, user) -> QuerySet[Tenant]:
    return Tenant.objects.filter(memberships__user_id=getattr(user, "pk", None), active=True).order_by("name")


def tenant_get_for_user(*, user, slug: str) -> Tenant:
    tenant = tenant_list_for_user(user=user).filter(slug=slug).first()
    if tenant is None:
        raise NotFoundError("Not found.")
    return tenant


def api_key_list_for_tenant(*, tenant_id: int) -> QuerySet[ApiKey]:
    return (
        ApiKey.objects.filter(tenant_id=tenant_id).select_related("created_by").order_by("-created_at", "-id")
    )


def api_key_get_for_user(*, user, api_key_id: int) -> ApiKey:
    api_key = (
        ApiKey.objects.filter(
            pk=api_key_id,
            tenant__memberships__user_id=getattr(user, "pk", None),
            tenant__active=True,
        )
        .select_related("tenant")
        .first()
    )
    if api_key is None:
        raise NotFoundError("Not found.")
    return api_key


def month_start(now: datetime | None = None) -> datetime:
    now = (now or timezone.now()).astimezone(UTC)
    return datetime(now.year, now.month, 1, tzinfo=UTC)


def quota_used_this_month(
    *, tenant_id: int, api_key_id: int | None = None, now: datetime | None = None
) -> int:
    """Tokens (prompt + completion) the ledger holds for this calendar month (UTC): the tenant's,
    or one of its keys'."""
    records = UsageRecord.objects.filter(tenant_id=tenant_id, created_at__gte=month_start(now))
    if api_key_id is not None:
        records = records.filter(api_key_id=api_key_id)
    totals = records.aggregate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
    return int(totals["tokens"] or 0)


@dataclass(frozen=True, slots=True)
class QuotaStatus:
    quota: int | None
    used: int
    remaining: int | None


def quota_status(*, tenant: Tenant) -> QuotaStatus:
    """Used tokens this month, counting in-flight reservations when Redis has the counter."""
    from tenants.ratelimit.limiter import quota_counter_value

    quota = getattr(getattr(tenant, "limits", None), "monthly_token_quota", None)
    counted = quota_counter_value(tenant_id=tenant.pk, period=timezone.now().strftime("%Y-%m"))
    used = counted if counted is not None else quota_used_this_month(tenant_id=tenant.pk)
    return QuotaStatus(quota=quota, used=used, remaining=None if quota is None else max(quota - used, 0))


_GROUP_FIELDS = {
    "day": (["day"], ["day"]),
    "model": (["model"], ["model"]),
    "key": (["api_key_id", "api_key__prefix", "api_key__name"], ["api_key_id"]),
}


def usage_summary(*, tenant_id: int, start: date, end: date, group_by: Sequence[str]) -> list[dict]:
    """Buckets of the tenant's ledger between two days (both included), one per combination of the
    `group_by` dimensions (day, model, key), ordered by them in that order."""
    if not group_by or len(set(group_by)) != len(group_by) or not set(group_by) <= set(GROUP_BY_CHOICES):
        raise ValueError(f"group_by must be distinct names of {GROUP_BY_CHOICES}")
    since = datetime.combine(start, time.min, tzinfo=UTC)
    until = datetime.combine(end, time.min, tzinfo=UTC) + timedelta(days=1)
    records = UsageRecord.objects.filter(tenant_id=tenant_id, created_at__gte=since, created_at__lt=until)
    # Per row, under a name of its own: the sums below take the columns' names.
    records = records.annotate(
        row_billed_tokens=ExpressionWrapper(
            (F("prompt_tokens") + F("completion_tokens")) * F("price_factor"),
            output_field=DecimalField(max_digits=24, decimal_places=3),
        )
    )
    if "day" in group_by:
        records = records.annotate(day=TruncDate("created_at", tzinfo=UTC))
    fields = [name for dimension in group_by for name in _GROUP_FIELDS[dimension][0]]
    order = [name for dimension in group_by for name in _GROUP_FIELDS[dimension][1]]
    rows = (
        records.order_by()
        .values(*fields)
        .annotate(
            requests=Count("id"),
            errors=Count("id", filter=Q(status=UsageRecord.Status.ERROR)),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cached_tokens=Sum("cached_tokens"),
            # Tokens at their price factor: a batch line's count for less (BATCH_PRICE_FACTOR).
            billed_tokens=Sum("row_billed_tokens"),
        )
        .order_by(*order)
    )
    return [dict(row) for row in rows]


def usage_per_day(*, records: QuerySet[UsageRecord]) -> list[dict]:
    """Requests and tokens per UTC day of any ledger queryset (the admin's filtered list)."""
    rows = (
        records.order_by()
        .annotate(day=TruncDate("created_at", tzinfo=UTC))
        .values("day")
        .annotate(requests=Count("id"), tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
        .order_by("day")
    )
    return [{"day": r["day"], "requests": r["requests"], "tokens": int(r["tokens"] or 0)} for r in rows]


def audit_list_for_tenant(*, tenant_id: int) -> QuerySet[AuditEntry]:
    """The tenant's audit entries, newest first."""
    return AuditEntry.objects.filter(tenant_id=tenant_id).order_by("-created_at", "-id")


def alert_list_for_tenant(*, tenant_id: int) -> QuerySet[Alert]:
    """The tenant's alerts, newest first, with their webhook deliveries."""
    return (
        Alert.objects.filter(tenant_id=tenant_id)
        .select_related("api_key")
        .prefetch_related("deliveries")
        .order_by("-created_at", "-id")
    )
