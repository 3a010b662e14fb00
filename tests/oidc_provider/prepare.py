"""Prepare the test identity provider's database: `python -m tests.oidc_provider.prepare CLIENT_ID
CLIENT_SECRET REDIRECT_URI USERNAME:PASSWORD[:EMAIL] ...` (with DJANGO_SETTINGS_MODULE and
OIDC_PROVIDER_DB set)."""

from __future__ import annotations

import sys

import django


def main(argv: list[str]) -> None:
    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from oauth2_provider.models import Application

    client_id, client_secret, redirect_uri, *users = argv
    call_command("migrate", verbosity=0)
    for spec in users:
        username, password, *email = spec.split(":")
        get_user_model().objects.create_user(
            username=username, password=password, email=email[0] if email else ""
        )
    Application.objects.create(
        name="pagoda",
        client_id=client_id,
        client_secret=client_secret,
        client_type=Application.CLIENT_CONFIDENTIAL,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=redirect_uri,
        algorithm=Application.RS256_ALGORITHM,
        skip_authorization=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
