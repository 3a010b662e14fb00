"""Celery tasks: thin wrappers around services, safe to run twice."""

from __future__ import annotations

from datetime import date, timedelta

from celery import shared_task
from django.utils import timezone

from tenants.services import audit_purge as purge_audit_entries
from tenants.services import usage_rollup


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
