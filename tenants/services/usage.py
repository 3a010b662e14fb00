"""The usage ledger (one append-only row per request) and its daily roll-up."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from django.db import IntegrityError, transaction
from django.db.models import Count, Q, Sum, Value
from django.db.models.functions import Coalesce

from tenants.models import UsageDaily, UsageRecord

_TOKEN_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def _non_negative(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def usage_record_create(
    *,
    tenant_id: int,
    api_key_id: int,
    model: str,
    adapter: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    time_to_first_token_ms: float | None,
    latency_ms: float,
    status: str,
    request_id: str,
    end_user: str = "",
    prompt_cache_key: str = "",
    service_tier: str = "default",
    batch_id: str = "",
    price_factor: float = 1.0,
    created_at: datetime | None = None,
) -> UsageRecord:
    """Write the request's ledger row. Calling again for the same request id returns that row.
    `created_at`: when the request ended, where the row is written later than that."""
    if status not in UsageRecord.Status.values:
        raise ValueError(f"status must be one of {UsageRecord.Status.values}, got {status!r}")
    record = UsageRecord(
        request_id=request_id,
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        model=model,
        adapter=adapter or None,
        prompt_tokens=_non_negative("prompt_tokens", prompt_tokens),
        completion_tokens=_non_negative("completion_tokens", completion_tokens),
        cached_tokens=_non_negative("cached_tokens", cached_tokens),
        time_to_first_token_ms=time_to_first_token_ms,
        latency_ms=latency_ms,
        status=status,
        end_user=end_user or "",
        prompt_cache_key=prompt_cache_key or "",
        service_tier=service_tier or "default",
        batch_id=batch_id or "",
        price_factor=Decimal(str(price_factor)),
    )
    if created_at is not None:
        record.created_at = created_at
    try:
        # A savepoint, so a duplicate does not poison a caller's surrounding transaction.
        with transaction.atomic():
            record.save(force_insert=True)
    except IntegrityError:
        existing = UsageRecord.objects.filter(request_id=request_id).first()
        if existing is None:
            raise
        return existing
    return record


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


@transaction.atomic
def usage_rollup(*, day: date) -> int:
    """Recompute the day's UsageDaily rows from the ledger (upsert; running it twice changes
    nothing). Returns the number of buckets."""
    start, end = day_bounds(day)
    buckets = (
        UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end)
        .order_by()  # the model's default ordering would split the GROUP BY
        .values("tenant_id", "api_key_id", "model", adapter_name=Coalesce("adapter", Value("")))
        .annotate(
            n_requests=Count("id"),
            n_errors=Count("id", filter=Q(status=UsageRecord.Status.ERROR)),
            **{f"sum_{f}": Sum(f) for f in _TOKEN_FIELDS},
        )
    )
    rows = [
        UsageDaily(
            day=day,
            tenant_id=b["tenant_id"],
            api_key_id=b["api_key_id"],
            model=b["model"],
            adapter=b["adapter_name"],
            requests=b["n_requests"],
            errors=b["n_errors"],
            **{f: b[f"sum_{f}"] or 0 for f in _TOKEN_FIELDS},
        )
        for b in buckets
    ]
    UsageDaily.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["day", "tenant", "api_key", "model", "adapter"],
        update_fields=["requests", "errors", *_TOKEN_FIELDS, "updated_at"],
    )
    # Buckets the ledger no longer has (it is append-only, so only after manual repairs) go.
    keep = {(r.tenant_id, r.api_key_id, r.model, r.adapter) for r in rows}
    stale = [
        pk
        for pk, *bucket in UsageDaily.objects.filter(day=day).values_list(
            "pk", "tenant_id", "api_key_id", "model", "adapter"
        )
        if tuple(bucket) not in keep
    ]
    if stale:
        UsageDaily.objects.filter(pk__in=stale).delete()
    return len(rows)
