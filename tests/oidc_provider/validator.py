from __future__ import annotations

import json
import os

from oauth2_provider.oauth2_validators import OAuth2Validator


class ClaimsValidator(OAuth2Validator):
    """Every user's extra claims (OIDC_PROVIDER_CLAIMS: {username: {claim: value}}) in the ID token
    and at the userinfo endpoint, whatever the scopes."""

    oidc_claim_scope = None

    def get_additional_claims(self, request):
        extra = json.loads(os.environ.get("OIDC_PROVIDER_CLAIMS", "{}")).get(request.user.username, {})
        return {"preferred_username": request.user.username, "email": request.user.email, **extra}
