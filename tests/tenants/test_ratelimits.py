from __future__ import annotations

import json
import time
import uuid

import pytest
from django.utils import timezone

from core.api.exceptions import error_response
from core.errors import QuotaExceededError, RateLimitError
from tenants.ratelimit import limiter
from tenants.services import (
    admission_reserve,
    admission_settle,
    api_key_authenticate,
    api_key_create,
    request_admit,
    tenant_limits_update,
    usage_record_create,
)
from tenants.types import Settlement
from tests.helpers import MODEL, bearer, usage_row

pytestmark = pytest.mark.django_db(transaction=True)

HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


def _auth(world, **limits):
    tenant_limits_update(tenant=world.tenant_a, **limits)
    return api_key_authenticate(raw_key=world.raw_key_a)


def _reserve(auth, *, prompt: int = 10, max_tokens: int = 90, request_id: str | None = None):
    return admission_reserve(
        auth=auth,
        model=MODEL,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        request_id=request_id or uuid.uuid4().hex,
    )


def test_the_61st_request_in_a_minute_under_60_rpm_gets_429_with_the_headers(world, api_client):
    _auth(world, requests_per_minute=60, tokens_per_minute=5000)
    for n in range(1, 61):
        response = api_client.get("/v1/usage", **bearer(world.raw_key_a))
        assert response.status_code == 200, response.content
        assert response["x-ratelimit-limit-requests"] == "60"
        assert response["x-ratelimit-remaining-requests"] == str(60 - n)
        assert response["x-ratelimit-limit-tokens"] == "5000"
        assert response["x-ratelimit-remaining-tokens"] == "5000"
    response = api_client.get("/v1/usage", **bearer(world.raw_key_a))
    assert response.status_code == 429
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["type"] == "requests"
    assert body["error"]["param"] is None
    assert "tenant requests per minute" in body["error"]["message"]
    assert 1 <= int(response["Retry-After"]) <= 60
    for name in HEADERS:
        assert response.has_header(name), name
    assert response["x-ratelimit-remaining-requests"] == "0"
    assert response["x-ratelimit-limit-requests"] == "60"
    # Another tenant is not affected.
    assert api_client.get("/v1/usage", **bearer(world.raw_key_b)).status_code == 200


def test_a_keys_own_rpm_limit_applies_under_the_tenants(world, api_client):
    _, raw_key = api_key_create(tenant=world.tenant_a, name="slow", requests_per_minute=2)
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=100)
    statuses = [api_client.get("/v1/usage", **bearer(raw_key)).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    # The tenant's other key still has room.
    assert api_client.get("/v1/usage", **bearer(world.raw_key_a)).status_code == 200


def test_the_window_slides_instead_of_resetting(world, monkeypatch):
    # A one-second window: what a fixed window would reset at its edge, a sliding log does not.
    monkeypatch.setattr(limiter, "WINDOW_SECONDS", 1)
    auth = _auth(world, requests_per_minute=4)
    request_admit(auth=auth)
    # Passages of time, not synchronisations: the window is Redis's clock (TIME), which no test moves.
    time.sleep(0.5)
    for _ in range(3):
        request_admit(auth=auth)
    with pytest.raises(RateLimitError):
        request_admit(auth=auth)
    time.sleep(0.6)  # the first request left the window, the other three have not
    request_admit(auth=auth)
    with pytest.raises(RateLimitError) as caught:
        request_admit(auth=auth)
    assert 1 <= int(caught.value.headers["retry-after"]) <= 1


def test_tokens_per_minute_limit_counts_reserved_tokens_and_settles_to_actual(world):
    auth = _auth(world, tokens_per_minute=1000)
    first = _reserve(auth, prompt=100, max_tokens=500)
    assert first.ratelimit_headers["x-ratelimit-remaining-tokens"] == "400"
    with pytest.raises(RateLimitError) as caught:
        _reserve(auth, prompt=100, max_tokens=400)
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.headers["x-ratelimit-remaining-tokens"] == "400"
    assert caught.value.headers["x-ratelimit-limit-tokens"] == "1000"
    assert "tenant tokens per minute" in caught.value.message
    admission_settle(reservation=first, settlement=Settlement(prompt_tokens=100, completion_tokens=20))
    second = _reserve(auth, prompt=100, max_tokens=400)
    assert second.ratelimit_headers["x-ratelimit-remaining-tokens"] == str(1000 - 120 - 500)


def test_a_keys_own_tokens_per_minute_limit_applies_under_the_tenants(world):
    _, raw_key = api_key_create(tenant=world.tenant_a, name="small", tokens_per_minute=150)
    tenant_limits_update(tenant=world.tenant_a, tokens_per_minute=10_000)
    small = api_key_authenticate(raw_key=raw_key)

    first = _reserve(small, prompt=50, max_tokens=50)
    assert (
        first.ratelimit_headers["x-ratelimit-limit-tokens"],
        first.ratelimit_headers["x-ratelimit-remaining-tokens"],
    ) == ("150", "50")
    with pytest.raises(RateLimitError, match="key tokens per minute") as caught:
        _reserve(small, prompt=50, max_tokens=50)
    assert caught.value.headers["x-ratelimit-remaining-tokens"] == "50"
    assert 1 <= int(caught.value.headers["retry-after"]) <= 60
    # The tenant's other key only sees the tenant's limit, which has room for both.
    other = _reserve(api_key_authenticate(raw_key=world.raw_key_a), prompt=50, max_tokens=50)
    assert other.ratelimit_headers["x-ratelimit-remaining-tokens"] == str(10_000 - 100 - 100)


def test_a_request_larger_than_the_token_limit_is_refused(world):
    auth = _auth(world, tokens_per_minute=100)
    with pytest.raises(RateLimitError, match="Request too large"):
        _reserve(auth, prompt=50, max_tokens=51)


def test_exhausted_quota_gives_insufficient_quota_and_should_not_retry(world):
    auth = _auth(world, monthly_token_quota=1000)
    usage_record_create(
        tenant_id=world.tenant_a.pk,
        api_key_id=world.key_a.pk,
        model=MODEL,
        adapter=None,
        prompt_tokens=600,
        completion_tokens=300,
        cached_tokens=0,
        time_to_first_token_ms=5.0,
        latency_ms=20.0,
        status="success",
        request_id="earlier",
    )
    fits = _reserve(auth, prompt=40, max_tokens=60)  # 900 + 100 = the whole quota
    used = limiter.quota_counter_value(tenant_id=world.tenant_a.pk, period=timezone.now().strftime("%Y-%m"))
    assert used == 1000
    with pytest.raises(QuotaExceededError) as caught:
        _reserve(auth, prompt=1, max_tokens=0)
    response = error_response(caught.value)
    assert response.status_code == 429
    assert response["x-should-retry"] == "false"
    body = json.loads(response.content)
    assert body["error"]["type"] == "insufficient_quota"
    assert body["error"]["code"] == "insufficient_quota"
    # Refused: nothing counted; a settle below the reservation frees quota again.
    assert limiter.in_flight_count(tenant_id=world.tenant_a.pk) == 1  # the admitted one's slot only
    admission_settle(reservation=fits, settlement=Settlement(prompt_tokens=40, completion_tokens=10))
    period = timezone.now().strftime("%Y-%m")
    assert limiter.quota_counter_value(tenant_id=world.tenant_a.pk, period=period) == 950
    _reserve(auth, prompt=20, max_tokens=30)


def test_concurrency_limit_per_tenant(world):
    auth = _auth(world, max_concurrent_requests=2)
    first, _second = _reserve(auth), _reserve(auth)
    with pytest.raises(RateLimitError, match="concurrent"):
        _reserve(auth)
    assert limiter.in_flight_count(tenant_id=world.tenant_a.pk) == 2
    admission_settle(reservation=first, settlement=Settlement(prompt_tokens=10, completion_tokens=5))
    _reserve(auth)
    assert limiter.in_flight_count(tenant_id=world.tenant_a.pk) == 2


def test_a_slot_leaked_by_a_dead_process_frees_itself_after_its_lease(world, settings):
    settings.TENANT_CONCURRENCY_LEASE_SECONDS = 1
    auth = _auth(world, max_concurrent_requests=1)
    _reserve(auth)  # never settled: the process "died"
    with pytest.raises(RateLimitError):
        _reserve(auth)
    time.sleep(1.1)  # a passage of time: the lease expires by Redis's clock, which no test moves
    _reserve(auth)


def test_refused_requests_count_nothing(world):
    auth = _auth(world, requests_per_minute=100, tokens_per_minute=100)
    with pytest.raises(RateLimitError):
        _reserve(auth, prompt=60, max_tokens=60)
    ok = _reserve(auth, prompt=10, max_tokens=10)
    assert ok.ratelimit_headers["x-ratelimit-remaining-requests"] == "99"
    assert ok.ratelimit_headers["x-ratelimit-remaining-tokens"] == "80"


def test_headers_are_set_on_successful_api_responses(world, api_client):
    _auth(world, requests_per_minute=10, tokens_per_minute=1000)
    response = api_client.get("/v1/usage", **bearer(world.raw_key_a))
    assert response.status_code == 200
    assert response["x-ratelimit-remaining-requests"] == "9"
    assert response["x-ratelimit-reset-requests"] == "1m0s"
    assert response["x-ratelimit-reset-tokens"] == "0ms"


def test_durations_use_openais_format():
    assert limiter.format_duration(20) == "20ms"
    assert limiter.format_duration(1500) == "1.5s"
    assert limiter.format_duration(12000) == "12s"
    assert limiter.format_duration(360000) == "6m0s"
    assert limiter.format_duration(61250) == "1m1.25s"


def test_a_keys_monthly_budget_is_its_own_under_the_tenants_quota(world):
    budgeted, raw_key = api_key_create(tenant=world.tenant_a, name="budgeted", monthly_token_budget=500)
    usage_row(budgeted, model=MODEL, prompt=300, completion=0, request_id="mine")
    usage_row(world.key_a, model=MODEL, prompt=1000, completion=0, request_id="the-other-keys")
    auth = api_key_authenticate(raw_key=raw_key)
    period = timezone.now().strftime("%Y-%m")

    fits = _reserve(auth, prompt=100, max_tokens=100)  # 300 + 200 = the whole budget

    assert limiter.key_budget_counter_value(api_key_id=budgeted.pk, period=period) == 500
    with pytest.raises(QuotaExceededError) as caught:
        _reserve(auth, prompt=1, max_tokens=0)
    body = json.loads(error_response(caught.value).content)
    assert (body["error"]["code"], body["error"]["message"]) == (
        "insufficient_quota",
        "This API key's monthly token budget is used up: it takes more requests next month, or once "
        "its budget is raised.",
    )
    # The tenant's other keys are not held by it; a settle below the reservation frees budget.
    _reserve(api_key_authenticate(raw_key=world.raw_key_a), prompt=1, max_tokens=0)
    admission_settle(reservation=fits, settlement=Settlement(prompt_tokens=100, completion_tokens=20))
    assert limiter.key_budget_counter_value(api_key_id=budgeted.pk, period=period) == 420
    _reserve(auth, prompt=40, max_tokens=40)


def test_a_budget_counter_lost_with_redis_is_rebuilt_from_the_keys_ledger(world):
    budgeted, raw_key = api_key_create(tenant=world.tenant_a, name="budgeted", monthly_token_budget=100)
    usage_row(budgeted, model=MODEL, prompt=60, completion=30, request_id="spent")
    auth = api_key_authenticate(raw_key=raw_key)

    with pytest.raises(QuotaExceededError):
        _reserve(auth, prompt=6, max_tokens=5)  # 90 + 11 > 100
    _reserve(auth, prompt=5, max_tokens=5)  # exactly the 100
