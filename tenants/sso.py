"""The OpenID Connect backend (mozilla-django-oidc) behind SSO_ENABLED: identities are matched by
issuer and subject, never by e-mail (an address is not proof of who someone is), and each sign-in
sets the user's tenants and roles from the claims (tenants.services.sso)."""

from __future__ import annotations

from django.conf import settings
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from tenants.services.sso import sso_user_for, sso_user_sync


class PagodaOIDCBackend(OIDCAuthenticationBackend):
    def verify_claims(self, claims) -> bool:
        return bool(claims.get("sub"))

    def filter_users_by_claims(self, claims):
        user = sso_user_for(claims=claims)
        if user is None:
            return self.UserModel.objects.none()
        return self.UserModel.objects.filter(pk=user.pk)

    def create_user(self, claims):
        return sso_user_sync(claims=claims)

    def update_user(self, user, claims):
        return sso_user_sync(claims=claims, user=user)


def sso_context(request) -> dict[str, bool]:
    """Whether the sign-in pages offer single sign-on."""
    return {"sso_enabled": settings.SSO_ENABLED}
