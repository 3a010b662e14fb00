"""Celery tasks: thin wrappers around services, safe to run twice."""

from __future__ import annotations

from datetime import date, timedelta

from celery import shared_task
from django.utils import timezone

from tenants.services import audit_purge as purge_audit_entries
from tenants.services import usage_rollup
from tenants.services.alerts import WebhookFailed, webhook_attempt, webhook_backoff_s
from tenants.services.alerts import alerts_check as check_alerts


@shared_task(name="tenants.tasks.usage_rollup_day")
def usage_rollup_day(day: str) -> int:
    return usage_rollup(day=date.fromisoformat(day))


@shared_task(name="tenants.tasks.usage_rollup_recent")
def usage_rollup_recent() -> dict[str, int]:
    """Yesterday too: requests that finished just after midnight land in yesterday's rows late."""
    today = timezone.now().date()
    return {day.isoformat(): usage_rollup(day=day) for day in (today - timedelta(days=1), today)}


@shared_task(name="tenants.tasks.audit_purge")
def audit_purge() -> int:
    return purge_audit_entries()


@shared_task(name="tenants.tasks.alerts_check")
def alerts_check() -> int:
    return check_alerts()


@shared_task(name="tenants.tasks.webhook_deliver")
def webhook_deliver(delivery_id: int) -> bool:
    """One attempt; a failure another attempt may fix queues the next one after a backoff
    (2, 4, 8 ... seconds up to 10 minutes, with jitter), until WEBHOOK_MAX_ATTEMPTS."""
    try:
        return webhook_attempt(delivery_id=delivery_id)
    except WebhookFailed as exc:
        countdown = webhook_backoff_s(attempts=exc.attempts)
        webhook_deliver.apply_async(args=(delivery_id,), countdown=countdown)
        return False
