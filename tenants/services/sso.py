"""Single sign-on users: an OpenID Connect identity (issuer, subject) is one user, created at its
first sign-in, and its tenants and roles are what the identity provider's claim says at each one.

The claim (SSO_TENANTS_CLAIM, "pagoda_tenants" by default) lists "<tenant slug>:<role>" strings or
{"tenant": slug, "role": role} objects, role one of owner, admin, member. The user's memberships
become exactly those of active tenants (an unknown tenant or role is ignored): a user whose claim
grants nothing has no tenant, and sees the "no tenant" page. SSO_STAFF_CLAIM true makes the user
staff and superuser (the admin); absent or false, neither. Every change is in the audit log.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from core.actor import Actor, acting_as
from tenants.models import Membership, SsoIdentity, Tenant
from tenants.services.audit import audit_record, audit_snapshot
from tenants.services.tenants import membership_create


def sso_issuer() -> str:
    if settings.SSO_ISSUER:
        return settings.SSO_ISSUER
    parts = urlsplit(settings.OIDC_OP_AUTHORIZATION_ENDPOINT)
    return f"{parts.scheme}://{parts.netloc}"


def sso_roles(claims: dict[str, Any]) -> dict[str, str]:
    """{tenant slug: role} from the tenants claim; what is malformed is left out."""
    granted: dict[str, str] = {}
    value = claims.get(settings.SSO_TENANTS_CLAIM) or []
    if isinstance(value, str):
        value = [value]
    for item in value if isinstance(value, list) else []:
        if isinstance(item, str) and ":" in item:
            slug, _, role = item.partition(":")
        elif isinstance(item, dict):
            slug, role = str(item.get("tenant", "")), str(item.get("role", ""))
        else:
            continue
        if role in Membership.Role.values and slug:
            granted[slug.strip()] = role
    return granted


def _new_username(claims: dict[str, Any]) -> str:
    base = claims.get("preferred_username") or (claims.get("email") or "").split("@")[0] or "sso-user"
    base = re.sub(r"[^\w.@+-]", "-", str(base))[:120] or "sso-user"
    User = get_user_model()
    name, n = base, 1
    while User.objects.filter(username=name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


@transaction.atomic
def sso_user_sync(*, claims: dict[str, Any], user=None):
    """The user of this identity, created at its first sign-in, with the tenants, roles and staff
    flag its claims give."""
    issuer = sso_issuer()
    actor = Actor(source="system", username=f"sso:{issuer}")
    with acting_as(actor):
        if user is None:
            user = get_user_model().objects.create_user(
                username=_new_username(claims), email=str(claims.get("email") or "")
            )
            user.set_unusable_password()
            user.save(update_fields=["password"])
            SsoIdentity.objects.create(user=user, issuer=issuer, subject=str(claims["sub"]))
        SsoIdentity.objects.filter(user=user).update(last_login_at=timezone.now())
        staff = claims.get(settings.SSO_STAFF_CLAIM) is True
        if (user.is_staff, user.is_superuser) != (staff, staff):
            before = audit_snapshot(user, fields=["is_staff", "is_superuser"])
            user.is_staff = user.is_superuser = staff
            user.save(update_fields=["is_staff", "is_superuser"])
            audit_record(
                action="update", obj=user, tenant_id=None, before=before,
                after=audit_snapshot(user, fields=["is_staff", "is_superuser"]),
            )  # fmt: skip
        granted = sso_roles(claims)
        tenants = {t.slug: t for t in Tenant.objects.filter(slug__in=granted, active=True)}
        for membership in Membership.objects.filter(user=user).select_related("tenant"):
            if membership.tenant.slug not in tenants:
                audit_record(
                    action="delete", obj=membership, tenant_id=membership.tenant_id,
                    before=audit_snapshot(membership),
                )  # fmt: skip
                membership.delete()
        for slug, tenant in tenants.items():
            membership_create(tenant=tenant, user=user, role=granted[slug])
    return user


def sso_user_for(*, claims: dict[str, Any]):
    """The user signed in with this identity before, or None."""
    identity = (
        SsoIdentity.objects.select_related("user")
        .filter(issuer=sso_issuer(), subject=str(claims.get("sub")))
        .first()
    )
    return None if identity is None else identity.user
