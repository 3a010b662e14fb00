"""Tenants, members and limits; the member-facing key operations used by the dashboard."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from core.errors import PermissionDeniedError
from tenants.models import ApiKey, Membership, Tenant, TenantLimits
from tenants.selectors import api_key_get_for_user, membership_get
from tenants.services.api_keys import (
    ROTATION_GRACE_DEFAULT,
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    auth_cache_invalidate,
)
from tenants.services.audit import audit_record, audit_snapshot

# The limits of a tenant that services (and the admin) set.
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "monthly_token_quota",
    "allowed_models",
    "fair_share_weight",
    "service_tiers",
    "max_queued_requests",
    "queue_timeout_seconds",
)
# Owners and admins manage a tenant's API keys and LoRA adapters; members only read.
MANAGER_ROLES = frozenset({Membership.Role.OWNER, Membership.Role.ADMIN})


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


# A limit not given: the setting's (TENANT_DEFAULT_LIMITS). None: unlimited.
DEFAULT: Any = _Default()


def tenant_default_limits() -> dict[str, int | None]:
    return dict(settings.TENANT_DEFAULT_LIMITS)


@transaction.atomic
def tenant_create(
    *,
    name: str,
    slug: str,
    requests_per_minute: int | None = DEFAULT,
    tokens_per_minute: int | None = DEFAULT,
    max_concurrent_requests: int | None = DEFAULT,
    monthly_token_quota: int | None = DEFAULT,
    max_queued_requests: int | None = DEFAULT,
    queue_timeout_seconds: int | None = DEFAULT,
    allowed_models: list[str] | None = None,
    fair_share_weight: int = 1,
    service_tiers: list[str] | None = None,
) -> Tenant:
    """A tenant and its limits: each limit not given is the TENANT_DEFAULT_LIMITS setting's, None
    is unlimited."""
    given = {
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
        "max_concurrent_requests": max_concurrent_requests,
        "monthly_token_quota": monthly_token_quota,
        "max_queued_requests": max_queued_requests,
        "queue_timeout_seconds": queue_timeout_seconds,
    }
    defaults = tenant_default_limits()
    limits = {name: defaults.get(name) if value is DEFAULT else value for name, value in given.items()}
    tenant = Tenant.objects.create(name=name, slug=slug)
    if service_tiers is not None:
        limits["service_tiers"] = list(service_tiers)
    tenant_limits = TenantLimits.objects.create(
        tenant=tenant,
        allowed_models=list(allowed_models or []),
        fair_share_weight=fair_share_weight,
        **limits,
    )
    audit_record(action="create", obj=tenant, tenant_id=tenant.pk, after=audit_snapshot(tenant))
    audit_record(
        action="create",
        obj=tenant_limits,
        tenant_id=tenant.pk,
        after=audit_snapshot(tenant_limits, fields=LIMIT_FIELDS),
    )
    return tenant


def tenant_limits_update(*, tenant: Tenant, **changes) -> TenantLimits:
    """Change limits; every process picks them up on its next request."""
    unknown = set(changes) - set(LIMIT_FIELDS)
    if unknown:
        raise TypeError(f"unknown limit fields: {sorted(unknown)}")
    with transaction.atomic():
        limits, _ = TenantLimits.objects.select_for_update().get_or_create(tenant=tenant)
        before = audit_snapshot(limits, fields=changes)
        for name, value in changes.items():
            setattr(limits, name, value)
        limits.save(update_fields=list(changes) or None)
        audit_record(
            action="update",
            obj=limits,
            tenant_id=tenant.pk,
            before=before,
            after=audit_snapshot(limits, fields=changes),
        )
    transaction.on_commit(auth_cache_invalidate)
    return limits


def tenant_set_active(*, tenant: Tenant, active: bool) -> Tenant:
    with transaction.atomic():
        was = Tenant.objects.select_for_update().values_list("active", flat=True).get(pk=tenant.pk)
        Tenant.objects.filter(pk=tenant.pk).update(active=active)
        tenant.active = active
        audit_record(
            action="update", obj=tenant, tenant_id=tenant.pk, before={"active": was}, after={"active": active}
        )
    transaction.on_commit(auth_cache_invalidate)
    return tenant


def membership_create(*, tenant: Tenant, user, role: str = Membership.Role.MEMBER) -> Membership:
    with transaction.atomic():
        membership, created = Membership.objects.get_or_create(
            tenant=tenant, user=user, defaults={"role": role}
        )
        if created:
            audit_record(
                action="create", obj=membership, tenant_id=tenant.pk, after=audit_snapshot(membership)
            )
        elif membership.role != role:
            before = {"role": membership.role}
            membership.role = role
            membership.save(update_fields=["role"])
            audit_record(
                action="update", obj=membership, tenant_id=tenant.pk, before=before, after={"role": role}
            )
    return membership


def membership_can_manage(*, membership: Membership) -> bool:
    return membership.role in MANAGER_ROLES


def membership_require_manager(*, user, tenant_id: int, what: str = "API keys") -> Membership:
    """The user's membership when it may manage the tenant's `what`; NotFoundError for outsiders,
    PermissionDeniedError for members."""
    membership = membership_get(user=user, tenant_id=tenant_id)
    if not membership_can_manage(membership=membership):
        raise PermissionDeniedError(f"Only owners and admins can manage {what}.")
    return membership


def api_key_create_for_member(
    *,
    user,
    tenant_id: int,
    name: str,
    expires_at: datetime | None = None,
    scope: str = ApiKey.Scope.ALL,
    allowed_models: list[str] | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    monthly_token_budget: int | None = None,
) -> tuple[ApiKey, str]:
    """Owners and admins create keys; members only read. Returns the key and its raw secret."""
    membership = membership_require_manager(user=user, tenant_id=tenant_id)
    return api_key_create(
        tenant=membership.tenant,
        name=name,
        created_by=user,
        expires_at=expires_at,
        scope=scope,
        allowed_models=allowed_models,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        monthly_token_budget=monthly_token_budget,
    )


def api_key_rotate_for_member(
    *, user, api_key_id: int, grace: timedelta = ROTATION_GRACE_DEFAULT
) -> tuple[ApiKey, str]:
    """Owners and admins rotate their tenant's keys (NotFoundError for anyone outside it)."""
    api_key = api_key_get_for_user(user=user, api_key_id=api_key_id)
    membership_require_manager(user=user, tenant_id=api_key.tenant_id)
    return api_key_rotate(api_key=api_key, grace=grace)


def api_key_revoke_for_member(*, user, api_key_id: int) -> ApiKey:
    """Owners and admins revoke their tenant's keys (NotFoundError for anyone outside it)."""
    api_key = api_key_get_for_user(user=user, api_key_id=api_key_id)
    membership_require_manager(user=user, tenant_id=api_key.tenant_id)
    return api_key_revoke(api_key=api_key)
