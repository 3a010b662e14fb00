"""Production settings and pages: placeholders refused, cookies and HSTS under TLS, a
Content-Security-Policy without inline scripts on every page, framing denied, failed logins
throttled (dashboard and admin)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tenants.models import Membership
from tenants.services import membership_create, tenant_create

ROOT = Path(__file__).resolve().parents[2]
INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*application/json)[^>]*>", re.IGNORECASE)
INLINE_HANDLER = re.compile(r"\son[a-z]+\s*=", re.IGNORECASE)


def _settings(env: dict[str, str], expression: str = "None") -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "REDIS_URL": "redis://127.0.0.1:6379/0"}
    probe = f"import config.settings as s; print(repr({expression}))"
    return subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("secrets", "message"),
    [
        (
            {"SECRET_KEY": "change-me-to-50-random-characters", "API_KEY_PEPPER": "y" * 32},
            ".env.example placeholder",
        ),
        ({"SECRET_KEY": "x" * 50, "API_KEY_PEPPER": "change-me-too"}, "API_KEY_PEPPER must be at least 16"),
    ],
)
def test_the_env_example_placeholders_do_not_start_in_production(secrets, message):
    result = _settings({"DEBUG": "false", **secrets})
    assert result.returncode != 0
    assert message in result.stderr


def test_behind_tls_cookies_are_secure_and_hsts_is_on():
    secrets = {"DEBUG": "false", "SECRET_KEY": "x" * 50, "API_KEY_PEPPER": "y" * 32}
    values = (
        "(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_SECONDS, s.SECURE_PROXY_SSL_HEADER)"
    )

    tls = _settings({**secrets, "BEHIND_TLS_PROXY": "true"}, values)
    plain = _settings(secrets, values)

    assert tls.stdout.strip() == "(True, True, 31536000, ('HTTP_X_FORWARDED_PROTO', 'https'))", tls.stderr
    assert plain.stdout.strip() == "(False, False, 0, None)", plain.stderr


@pytest.fixture
def member(db) -> tuple[Client, str]:
    tenant = tenant_create(name="Acme", slug="acme", allowed_models=[])
    user = get_user_model().objects.create_user("ann", password="right-password-1")
    membership_create(tenant=tenant, user=user, role=Membership.Role.OWNER)
    client = Client()
    client.force_login(user)
    return client, tenant.slug


@pytest.mark.django_db
def test_every_page_has_a_policy_without_inline_scripts_and_cannot_be_framed(member, settings):
    client, slug = member
    operator = Client()
    operator.force_login(get_user_model().objects.create_superuser("op", "op@example.com", "pw"))
    pages = [
        (Client(), "/dashboard/login/"),
        (client, f"/dashboard/t/{slug}/"),
        (client, f"/dashboard/t/{slug}/keys/"),
        (client, f"/dashboard/t/{slug}/adapters/"),
        (client, f"/dashboard/t/{slug}/usage/"),
        (client, f"/dashboard/t/{slug}/playground/"),
        (operator, "/admin/"),
        (operator, "/admin/tenants/tenant/add/"),
    ]
    for page_client, path in pages:
        response = page_client.get(path)
        assert response.status_code == 200, path
        policy = response["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy, path
        assert "unsafe-inline" not in policy.split("script-src")[1].split(";")[0], path
        assert response["X-Frame-Options"] == "DENY", path
        html = response.content.decode()
        assert not INLINE_SCRIPT.search(html), (path, INLINE_SCRIPT.search(html))
        assert not INLINE_HANDLER.search(html), (path, INLINE_HANDLER.search(html))


@pytest.mark.django_db
@pytest.mark.parametrize("login_path", ["/dashboard/login/", "/admin/login/"])
def test_repeated_failed_logins_lock_the_user_out_from_that_address(member, settings, login_path):
    settings.AXES_FAILURE_LIMIT = 3
    get_user_model().objects.filter(username="ann").update(is_staff=True)
    client = Client()
    form = {"username": "ann", "password": "wrong"}

    failures = [client.post(login_path, form).status_code for _ in range(3)]
    locked = client.post(login_path, {"username": "ann", "password": "right-password-1"})
    elsewhere = Client(REMOTE_ADDR="10.0.0.9").post(
        login_path, {"username": "ann", "password": "right-password-1"}
    )

    assert failures == [200, 200, 429]  # the form again with its error, then locked at the limit
    assert locked.status_code == 429
    assert "Too many failed sign-ins" in locked.content.decode()
    assert elsewhere.status_code == 302  # the same user from another address is not locked out
