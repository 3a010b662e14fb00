from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from tenants.errors import AuthenticationError, PermissionDeniedError
from tenants.models import ApiKey
from tenants.services import (
    api_key_authenticate,
    api_key_create,
    api_key_digest,
    api_key_revoke,
    tenant_limits_update,
    tenant_set_active,
)
from tests.tenants.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]


def test_key_secret_is_never_stored(world):
    raw_key = world.raw_key_a
    prefix, secret = raw_key.removeprefix("sk-").split("_", 1)
    assert len(secret) >= 43  # 32 random bytes
    row = ApiKey.objects.filter(pk=world.key_a.pk).values().get()
    stored = " ".join(str(value) for value in row.values())
    assert secret not in stored
    assert raw_key not in stored
    assert row["prefix"] == prefix
    assert row["digest"] == api_key_digest(raw_key=raw_key)
    assert secret not in row["digest"]
    # And nowhere else in the database either.
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_jsonb(t)::text FROM tenants_apikey t")
        assert all(secret not in text for (text,) in cursor.fetchall())


def test_key_authenticates_to_its_tenant_and_key(world):
    context = api_key_authenticate(raw_key=world.raw_key_a)
    assert context.tenant_id == world.tenant_a.pk
    assert context.tenant_slug == "tenant-a"
    assert context.api_key_id == world.key_a.pk
    assert context.api_key_prefix == world.key_a.display_prefix
    assert context.allowed_models == (MODEL, "other-model")
    assert context.tenant_limits.requests_per_minute is None


def test_a_wrong_secret_behind_a_real_prefix_is_refused(world):
    api_key_authenticate(raw_key=world.raw_key_a)  # cached now
    forged = world.raw_key_a[:-4] + ("AAAA" if not world.raw_key_a.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthenticationError) as caught:
        api_key_authenticate(raw_key=forged)
    assert caught.value.code == "invalid_api_key"
    assert caught.value.status_code == 401


@pytest.mark.parametrize("raw_key", ["", "sk-", "Bearer x", "sk-zzzzzzzzzzzz_" + "a" * 43, "sk-0123456789ab_short"])
def test_malformed_keys_are_refused(db, raw_key):
    with pytest.raises(AuthenticationError):
        api_key_authenticate(raw_key=raw_key)


def test_key_models_narrow_the_tenants_models_and_never_widen_them(world):
    _, raw_key = api_key_create(tenant=world.tenant_a, name="narrow", allowed_models=["other-model", "not-the-tenants"])
    assert api_key_authenticate(raw_key=raw_key).allowed_models == ("other-model",)


def test_expired_key_is_refused_at_its_time(world):
    api_key, raw_key = api_key_create(
        tenant=world.tenant_a, name="short-lived", expires_at=timezone.now() + timedelta(seconds=1)
    )
    assert api_key_authenticate(raw_key=raw_key).api_key_id == api_key.pk  # and cached
    time.sleep(max(0.0, (api_key.expires_at - timezone.now()).total_seconds()) + 0.05)
    with pytest.raises(AuthenticationError, match="expired"):
        api_key_authenticate(raw_key=raw_key)


@pytest.mark.django_db(transaction=True)
def test_key_of_an_inactive_tenant_is_refused(world):
    api_key_authenticate(raw_key=world.raw_key_a)
    tenant_set_active(tenant=world.tenant_a, active=False)
    with pytest.raises(PermissionDeniedError) as caught:
        api_key_authenticate(raw_key=world.raw_key_a)
    assert caught.value.code == "tenant_inactive"


@pytest.mark.django_db(transaction=True)
def test_limit_changes_reach_cached_contexts_at_once(world):
    assert api_key_authenticate(raw_key=world.raw_key_a).tenant_limits.requests_per_minute is None
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=7)
    assert api_key_authenticate(raw_key=world.raw_key_a).tenant_limits.requests_per_minute == 7


@pytest.mark.django_db(transaction=True)
def test_last_used_at_is_written_at_most_once_a_minute(world):
    api_key_authenticate(raw_key=world.raw_key_a)
    first = ApiKey.objects.get(pk=world.key_a.pk).last_used_at
    assert first is not None
    api_key_authenticate(raw_key=world.raw_key_a)
    assert ApiKey.objects.get(pk=world.key_a.pk).last_used_at == first


@pytest.mark.django_db(transaction=True)
def test_revoked_key_is_refused_within_one_second_in_this_process(world):
    api_key_authenticate(raw_key=world.raw_key_a)  # cached for API_KEY_CACHE_SECONDS
    api_key_revoke(api_key=world.key_a)
    with pytest.raises(AuthenticationError, match="revoked"):
        api_key_authenticate(raw_key=world.raw_key_a)


_WATCHER = textwrap.dedent(
    """
    import sys, time
    import django
    django.setup()
    from tenants.errors import AuthenticationError
    from tenants.services import api_key_authenticate
    raw_key = sys.stdin.readline().strip()
    api_key_authenticate(raw_key=raw_key)  # now cached in this process
    print("ready", flush=True)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            api_key_authenticate(raw_key=raw_key)
        except AuthenticationError as exc:
            print(f"refused {time.time()!r} {exc.message}", flush=True)
            sys.exit(0)
        time.sleep(0.005)
    print("still accepted", flush=True)
    """
)


def _test_database_env() -> dict[str, str]:
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    url = f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "config.settings"}


@pytest.mark.django_db(transaction=True)
def test_revoked_key_is_refused_within_one_second_by_another_process(world):
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER],
        cwd=ROOT,
        env=_test_database_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        watcher.stdin.write(world.raw_key_a + "\n")
        watcher.stdin.flush()
        assert watcher.stdout.readline().strip() == "ready", watcher.stderr.read()
        revoked_at = time.time()
        api_key_revoke(api_key=world.key_a)
        line = watcher.stdout.readline().strip()
        assert line.startswith("refused "), line + watcher.stderr.read()
        refused_at = float(line.split()[1])
        assert refused_at - revoked_at < 1.0
        assert line.endswith("This API key has been revoked.")
        assert watcher.wait(timeout=30) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
