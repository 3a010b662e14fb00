"""The audit log: every change a person or a key makes to keys, limits and tiers, members and
roles, adapters, deployments and tenant settings, from the admin, the dashboard and the API.

Services record their own changes with `audit_record` (the actor is the request's, core.actor);
the admin records what its forms change (tenants.admin_audit). Entries are append-only
(tenants.models.AuditEntry); `audit_purge` removes those past AUDIT_RETENTION_DAYS.

Secrets never enter the log: digests, passwords and file contents are left out of snapshots.
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.actor import current_actor
from tenants.models import AuditEntry

# Never logged, whatever the model: what would let a reader act as someone.
SECRET_FIELDS = frozenset({"digest", "previous_digest", "password", "secret", "token", "webhook_secret"})


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a field's value."""
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, models.Model):
        return value.pk
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def audit_snapshot(obj: models.Model, *, fields: Iterable[str] | None = None) -> dict[str, Any]:
    """The object's concrete fields (foreign keys by id), secrets left out."""
    names = set(fields) if fields is not None else None
    snapshot: dict[str, Any] = {}
    for field in obj._meta.concrete_fields:
        if field.name in SECRET_FIELDS or isinstance(field, models.FileField):
            continue
        if getattr(field, "auto_now", False):  # "updated_at": it changes with every save, says nothing
            continue
        if names is not None and field.name not in names:
            continue
        snapshot[field.name] = _plain(getattr(obj, field.attname))
    return snapshot


def audit_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, list[Any]]:
    """{field: [before, after]} for the fields whose values differ (a missing side is None)."""
    return {
        name: [before.get(name), after.get(name)]
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    }


def audit_record(
    *,
    action: str,
    obj: models.Model,
    tenant_id: int | None,
    before: Mapping[str, Any] | None = None,
    after: Mapping[str, Any] | None = None,
    object_repr: str | None = None,
) -> AuditEntry | None:
    """Append one entry for `obj`, by the request's actor. An update that changed nothing writes
    nothing (None)."""
    changes = audit_changes(before or {}, after or {})
    if action == "update" and not changes:
        return None
    actor = current_actor()
    tenant_slug = ""
    if tenant_id is not None:
        from tenants.models import Tenant

        tenant_slug = Tenant.objects.filter(pk=tenant_id).values_list("slug", flat=True).first() or ""
    return AuditEntry.objects.create(
        tenant_id=tenant_id,
        tenant_slug=tenant_slug,
        source=actor.source,
        actor_user_id=actor.user_id,
        actor_api_key_id=actor.api_key_id,
        actor=actor.label[:200],
        address=actor.address,
        action=action,
        object_type=obj._meta.model_name or type(obj).__name__.lower(),
        object_id=str(obj.pk),
        object_repr=(object_repr if object_repr is not None else str(obj))[:200],
        changes=changes,
    )


def audit_purge(*, now: dt.datetime | None = None) -> int:
    """Remove the entries older than AUDIT_RETENTION_DAYS; returns how many."""
    horizon = (now or timezone.now()) - dt.timedelta(days=settings.AUDIT_RETENTION_DAYS)
    return AuditEntry.objects.filter(created_at__lt=horizon).purge()
