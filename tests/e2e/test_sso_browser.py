"""Single sign-on in headless Chromium: a real OpenID Connect provider (django-oauth-toolkit, a
Django project of its own in another process, tests/oidc_provider) and a real daphne of the
platform. The code flow end to end: the platform's sign-in page, the provider's, back to the
platform; a first sign-in with the tenant claim lands on the tenant, one without it gets no access."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from django.contrib.auth import get_user_model

from tenants.models import AuditEntry, Membership, SsoIdentity
from tests.e2e.browser import chromium, screenshot
from tests.e2e.processes import ROOT, free_port, spawn, wait_for_http, web_server

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CLIENT_ID, CLIENT_SECRET = "pagoda-dashboard", "test-client-secret-of-the-sso-browser-test"
USERS = {"alice": "alice-password", "bob": "bob-password"}


def _provider_env(tmp_path: Path, claims: dict) -> dict[str, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key_file = tmp_path / "idp-key.pem"
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return {
        "DJANGO_SETTINGS_MODULE": "tests.oidc_provider.settings",
        "OIDC_PROVIDER_DB": str(tmp_path / "idp.sqlite3"),
        "OIDC_PROVIDER_RSA_KEY_FILE": str(key_file),
        "OIDC_PROVIDER_CLAIMS": json.dumps(claims),
        "PYTHONPATH": str(ROOT),
    }


@contextlib.contextmanager
def identity_provider(tmp_path: Path, *, port: int, redirect_uri: str, claims: dict) -> Iterator[str]:
    """The provider on localhost:port (another host name than the platform's 127.0.0.1, so the
    browser keeps their cookies apart), with USERS and the platform registered as a client."""
    env = _provider_env(tmp_path, claims)
    users = [f"{name}:{password}:{name}@idp.example" for name, password in USERS.items()]
    prepare = [
        sys.executable,
        "-m",
        "tests.oidc_provider.prepare",
        CLIENT_ID,
        CLIENT_SECRET,
        redirect_uri,
        *users,
    ]
    subprocess.run(prepare, cwd=ROOT, env={**os.environ, **env}, check=True, timeout=120)
    argv = [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{port}", "--noreload"]
    provider = spawn("identity provider", argv, tmp_path / "idp.log", **env)
    base = f"http://localhost:{port}"
    try:
        wait_for_http(base + "/o/.well-known/openid-configuration", timeout=60, process=provider.popen)
        yield base
    finally:
        provider.stop()


def _sign_in(driver, base_url: str, username: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 30)
    driver.get(base_url + "/dashboard/login/")
    driver.find_element(By.ID, "sso-login").click()
    wait.until(ec.presence_of_element_located((By.ID, "idp-username")))
    driver.find_element(By.ID, "idp-username").send_keys(username)
    driver.find_element(By.ID, "idp-password").send_keys(USERS[username])
    driver.find_element(By.ID, "idp-submit").click()
    wait.until(lambda d: d.current_url.startswith(base_url + "/dashboard/"))


def test_a_first_sign_in_with_the_tenant_claim_lands_on_the_tenant_and_without_it_gets_no_access(
    world, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    tenant = world.tenant_a
    port = free_port()
    idp = f"http://localhost:{port}"
    sso_env = {
        "PAGODA_OIDC_CLIENT_ID": CLIENT_ID,
        "PAGODA_OIDC_CLIENT_SECRET": CLIENT_SECRET,
        "PAGODA_OIDC_AUTHORIZATION_ENDPOINT": f"{idp}/o/authorize/",
        "PAGODA_OIDC_TOKEN_ENDPOINT": f"{idp}/o/token/",
        "PAGODA_OIDC_USERINFO_ENDPOINT": f"{idp}/o/userinfo/",
        "PAGODA_OIDC_JWKS_ENDPOINT": f"{idp}/o/.well-known/jwks.json",
    }
    claims = {"alice": {"pagoda_tenants": [f"{tenant.slug}:admin"]}, "bob": {}}

    with (
        web_server(log_path=tmp_path / "daphne.log", **sso_env) as base_url,
        identity_provider(tmp_path, port=port, redirect_uri=base_url + "/oidc/callback/", claims=claims),
    ):
        with chromium() as driver:  # a browser of its own per person: the provider's session too
            _sign_in(driver, base_url, "alice")
            WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, "logout")))
            screenshot(driver, "sso-alice")
            assert driver.current_url == f"{base_url}/dashboard/t/{tenant.slug}/"
            assert driver.find_elements(By.ID, "nav-audit")  # an admin of the tenant

        with urllib.request.urlopen(base_url + "/admin/login/", timeout=10) as response:
            assert 'id="sso-login"' in response.read().decode()  # the admin offers it too

        with chromium() as driver:
            _sign_in(driver, base_url, "bob")
            screenshot(driver, "sso-bob")
            assert driver.current_url == f"{base_url}/dashboard/"
            assert "Your account is not a member of any tenant." in driver.page_source

    alice = SsoIdentity.objects.get(user__email="alice@idp.example").user
    bob = SsoIdentity.objects.get(user__email="bob@idp.example").user
    assert not alice.has_usable_password() and not bob.has_usable_password()
    assert list(Membership.objects.filter(user=alice).values_list("tenant__slug", "role")) == [
        (tenant.slug, "admin")
    ]
    assert not Membership.objects.filter(user=bob).exists()
    assert (
        AuditEntry.objects.filter(object_type="membership", action="create", actor=f"sso:{idp}").count() == 1
    )
    assert get_user_model().objects.filter(username__in=["alice", "bob"]).count() == 2
