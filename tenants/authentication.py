"""DRF authentication for /v1: `Authorization: Bearer <key>` → the key's AuthContext."""

from __future__ import annotations

from dataclasses import dataclass

from rest_framework.authentication import BaseAuthentication

from tenants.services import api_key_authenticate, bearer_token
from tenants.types import AuthContext


@dataclass(frozen=True, slots=True)
class ApiKeyUser:
    """The caller of a /v1 request: a key, not a person. Quacks enough like a user for DRF."""

    api_key_id: int
    tenant_id: int
    is_authenticated: bool = True
    is_anonymous: bool = False
    is_active: bool = True
    is_staff: bool = False
    is_superuser: bool = False
    pk: None = None
    id: None = None

    def __str__(self) -> str:
        return f"api-key:{self.api_key_id}"


@dataclass(frozen=True, slots=True)
class TenantRef:
    id: int
    slug: str


@dataclass(frozen=True, slots=True)
class ApiKeyRef:
    id: int
    prefix: str


class ApiKeyAuthentication(BaseAuthentication):
    """Required, not optional: a /v1 request without a valid key is refused with 401
    (AuthenticationError, rendered by the API exception handler)."""

    def authenticate(self, request):
        raw_key = bearer_token(authorization=request.META.get("HTTP_AUTHORIZATION"))
        context: AuthContext = api_key_authenticate(raw_key=raw_key)
        # Also on the Django request, so middleware and logging see who called.
        for target in (request, request._request):
            target.tenant = TenantRef(id=context.tenant_id, slug=context.tenant_slug)
            target.api_key = ApiKeyRef(id=context.api_key_id, prefix=context.api_key_prefix)
        return ApiKeyUser(api_key_id=context.api_key_id, tenant_id=context.tenant_id), context

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="api"'
