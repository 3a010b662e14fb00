from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from core.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError
from core.redis_client import get_redis
from tenants.models import ApiKey
from tenants.ratelimit.limiter import open_settlements_key
from tenants.services import (
    api_key_authenticate,
    api_key_create,
    api_key_digest,
    api_key_revoke,
    api_key_rotate,
    tenant_limits_update,
    tenant_set_active,
)
from tests.e2e.processes import web_server
from tests.helpers import MODEL, wait_until


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
    assert context.tenant_limits.requests_per_minute == settings.TENANT_DEFAULT_LIMITS["requests_per_minute"]


def test_a_wrong_secret_behind_a_real_prefix_is_refused(world):
    api_key_authenticate(raw_key=world.raw_key_a)  # cached now
    forged = world.raw_key_a[:-4] + ("AAAA" if not world.raw_key_a.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthenticationError) as caught:
        api_key_authenticate(raw_key=forged)
    assert caught.value.code == "invalid_api_key"
    assert caught.value.status_code == 401


@pytest.mark.parametrize(
    "raw_key", ["", "sk-", "Bearer x", "sk-zzzzzzzzzzzz_" + "a" * 43, "sk-0123456789ab_short"]
)
def test_malformed_keys_are_refused(db, raw_key):
    with pytest.raises(AuthenticationError):
        api_key_authenticate(raw_key=raw_key)


def test_key_models_narrow_the_tenants_models_and_never_widen_them(world):
    _, raw_key = api_key_create(
        tenant=world.tenant_a, name="narrow", allowed_models=["other-model", "not-the-tenants"]
    )
    assert api_key_authenticate(raw_key=raw_key).allowed_models == ("other-model",)


def test_expired_key_is_refused_at_its_time(world, monkeypatch):
    api_key, raw_key = api_key_create(
        tenant=world.tenant_a, name="short-lived", expires_at=timezone.now() + timedelta(seconds=1)
    )
    assert api_key_authenticate(raw_key=raw_key).api_key_id == api_key.pk  # and cached
    # The clock moves past the expiry instead of the test waiting for it.
    monkeypatch.setattr(timezone, "now", lambda: api_key.expires_at + timedelta(milliseconds=50))
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
    assert (
        api_key_authenticate(raw_key=world.raw_key_a).tenant_limits.requests_per_minute
        == settings.TENANT_DEFAULT_LIMITS["requests_per_minute"]
    )
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


@pytest.fixture(scope="module")
def web_process(django_db_setup, tmp_path_factory) -> Iterator[str]:
    """A daphne serving the test database: another web process, with its own key cache. Its settler
    sweeps once, at its start, and finds nothing to settle: the reservations that earlier tests left
    open in this session's Redis are dropped first. Settling them (a ledger row each, and a wait for
    an abandoned request's engines) could outlast a short test, and a sweep writing a ledger row
    while the test's teardown truncated the tables deadlocked the two."""
    get_redis().delete(open_settlements_key())
    with web_server(
        log_path=tmp_path_factory.mktemp("web") / "daphne.log", PAGODA_SETTLER_SWEEP_S="86400"
    ) as base_url:
        yield base_url


def _get_usage(base_url: str, raw_key: str) -> tuple[int, dict]:
    request = urllib.request.Request(base_url + "/v1/usage", headers={"Authorization": f"Bearer {raw_key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.django_db(transaction=True)
def test_revoked_key_is_refused_within_one_second_by_another_web_process(world, web_process):
    assert _get_usage(web_process, world.raw_key_a)[0] == 200  # resolved and cached by that process
    assert _get_usage(web_process, world.raw_key_a)[0] == 200  # served from its cache

    def refused() -> tuple[int, dict] | None:
        answer = _get_usage(web_process, world.raw_key_a)
        return answer if answer[0] != 200 else None

    revoked_at = time.monotonic()
    api_key_revoke(api_key=world.key_a)
    answer = wait_until(refused, timeout=5, interval=0, what="the other process to refuse the revoked key")
    elapsed = time.monotonic() - revoked_at

    assert answer == (
        401,
        {
            "error": {
                "message": "This API key has been revoked.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
    )
    assert elapsed < 1.0
    assert _get_usage(web_process, world.raw_key_b)[0] == 200


@pytest.mark.django_db(transaction=True)
def test_expired_key_is_refused_by_another_web_process_at_its_time(world, web_process):
    assert _get_usage(web_process, world.raw_key_b)[0] == 200  # the server is warm
    api_key, raw_key = api_key_create(
        tenant=world.tenant_a, name="short-lived", expires_at=timezone.now() + timedelta(seconds=2)
    )
    assert _get_usage(web_process, raw_key)[0] == 200

    # A passage of time, not a synchronisation: the other process's clock cannot be moved.
    time.sleep(max(0.0, (api_key.expires_at - timezone.now()).total_seconds()) + 0.05)

    status, body = _get_usage(web_process, raw_key)
    assert status == 401
    assert (body["error"]["code"], body["error"]["message"]) == (
        "invalid_api_key",
        "This API key has expired.",
    )


def test_a_rotated_key_takes_its_new_secret_and_keeps_the_old_one_for_the_grace_period(world):
    old_context = api_key_authenticate(raw_key=world.raw_key_a)  # and cached

    api_key, new_raw = api_key_rotate(api_key=world.key_a, grace=timedelta(hours=24))

    assert new_raw != world.raw_key_a and new_raw.startswith(f"{world.key_a.display_prefix}_")
    assert api_key.pk == world.key_a.pk and api_key.previous_digest == world.key_a.digest
    assert api_key_authenticate(raw_key=new_raw) == old_context  # same key: limits, scope, ledger
    assert api_key_authenticate(raw_key=world.raw_key_a) == old_context
    assert api_key.previous_valid_until - timezone.now() > timedelta(hours=23, minutes=59)


def test_the_old_secret_of_a_rotation_is_refused_at_the_end_of_its_grace_period(world, monkeypatch):
    api_key, new_raw = api_key_rotate(api_key=world.key_a, grace=timedelta(seconds=1))
    assert api_key_authenticate(raw_key=world.raw_key_a).api_key_id == api_key.pk  # and cached
    # The clock moves past the grace period instead of the test waiting for it.
    end = api_key.previous_valid_until
    monkeypatch.setattr(timezone, "now", lambda: end + timedelta(milliseconds=50))

    with pytest.raises(AuthenticationError, match="rotated and its grace period is over"):
        api_key_authenticate(raw_key=world.raw_key_a)
    assert api_key_authenticate(raw_key=new_raw).api_key_id == api_key.pk


@pytest.mark.django_db(transaction=True)
def test_a_rotation_without_grace_refuses_the_old_secret_at_once_in_every_process(world):
    api_key_authenticate(raw_key=world.raw_key_a)  # cached

    _, new_raw = api_key_rotate(api_key=world.key_a, grace=timedelta(0))

    with pytest.raises(AuthenticationError) as refused:
        api_key_authenticate(raw_key=world.raw_key_a)
    assert refused.value.code == "invalid_api_key"
    assert api_key_authenticate(raw_key=new_raw).api_key_id == world.key_a.pk


def test_a_second_rotation_drops_the_secret_the_first_one_kept(world):
    _, second_raw = api_key_rotate(api_key=world.key_a)
    _, third_raw = api_key_rotate(api_key=world.key_a)

    with pytest.raises(AuthenticationError):
        api_key_authenticate(raw_key=world.raw_key_a)
    assert api_key_authenticate(raw_key=second_raw).api_key_id == world.key_a.pk
    assert api_key_authenticate(raw_key=third_raw).api_key_id == world.key_a.pk


def test_a_revoked_key_cannot_be_rotated_and_keeps_its_digest(world):
    api_key_revoke(api_key=world.key_a)
    digest = ApiKey.objects.get(pk=world.key_a.pk).digest

    with pytest.raises(InvalidRequestError, match="revoked key cannot be rotated"):
        api_key_rotate(api_key=world.key_a)

    assert ApiKey.objects.get(pk=world.key_a.pk).digest == digest


@pytest.mark.django_db(transaction=True)
def test_a_rotated_secret_is_refused_by_another_web_process_at_the_end_of_its_grace(world, web_process):
    assert _get_usage(web_process, world.raw_key_b)[0] == 200  # the server is warm
    assert _get_usage(web_process, world.raw_key_a)[0] == 200  # resolved and cached there
    api_key, new_raw = api_key_rotate(api_key=world.key_a, grace=timedelta(seconds=2))
    assert _get_usage(web_process, world.raw_key_a)[0] == 200
    assert _get_usage(web_process, new_raw)[0] == 200

    # A passage of time, not a synchronisation: the other process's clock cannot be moved.
    time.sleep(max(0.0, (api_key.previous_valid_until - timezone.now()).total_seconds()) + 0.05)

    status, body = _get_usage(web_process, world.raw_key_a)
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    assert body["error"]["message"] == "This API key's secret was rotated and its grace period is over."
    assert _get_usage(web_process, new_raw)[0] == 200
