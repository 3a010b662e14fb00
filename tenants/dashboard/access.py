"""Who may see and do what on the dashboard, resolved from the signed-in user's memberships.

Every tenant-scoped page is looked up through the user's membership: an outsider gets a 404 for
another tenant's pages and objects, never a hint that they exist.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse

from core import errors
from core.actor import Actor, acting_as
from core.client_address import client_address
from tenants.models import Membership, Tenant
from tenants.selectors import membership_get, tenant_get_for_user
from tenants.services import membership_can_manage, membership_require_manager


@dataclass(frozen=True, slots=True)
class TenantAccess:
    user: object
    tenant: Tenant
    membership: Membership
    memberships: list[Membership]

    @property
    def can_manage(self) -> bool:
        """Whether the user may manage the tenant's keys and adapters (the services decide)."""
        return membership_can_manage(membership=self.membership)

    def require_manager(self, *, what: str) -> None:
        """PermissionDeniedError (a 403 page) unless the services let the user manage `what`."""
        membership_require_manager(user=self.user, tenant_id=self.tenant.pk, what=what)

    def context(self, **extra) -> dict:
        return {
            "tenant": self.tenant,
            "membership": self.membership,
            "memberships": self.memberships,
            "can_manage_keys": self.can_manage,
            **extra,
        }


def memberships_for_user(*, user) -> list[Membership]:
    return list(
        Membership.objects.filter(user_id=user.pk, tenant__active=True)
        .select_related("tenant")
        .order_by("tenant__name", "tenant_id")
    )


def tenant_access(*, user, slug: str) -> TenantAccess:
    tenant = tenant_get_for_user(user=user, slug=slug)
    membership = membership_get(user=user, tenant_id=tenant.pk)
    return TenantAccess(
        user=user, tenant=tenant, membership=membership, memberships=memberships_for_user(user=user)
    )


def tenant_page(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Login required; resolves `slug` to a TenantAccess (404 for non-members) and maps the
    services' errors to Django's 404/403."""

    @login_required
    @functools.wraps(view)
    def wrapper(request: HttpRequest, slug: str, *args, **kwargs) -> HttpResponse:
        actor = Actor(
            source="dashboard",
            user_id=request.user.pk,
            username=request.user.get_username(),
            address=client_address(request),
        )
        try:
            with acting_as(actor):
                access = tenant_access(user=request.user, slug=slug)
                return view(request, access, *args, **kwargs)
        except errors.NotFoundError as exc:
            raise Http404(exc.message) from exc
        except errors.PermissionDeniedError as exc:
            raise PermissionDenied(exc.message) from exc

    return wrapper
