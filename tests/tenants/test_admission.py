from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections
from django.utils import timezone

from core.errors import InvalidRequestError, NotFoundError, QuotaExceededError
from core.redis_client import get_redis
from tenants.ratelimit import limiter
from tenants.services import (
    admission_reserve,
    admission_settle,
    api_key_authenticate,
    api_key_create,
    model_access_check,
    tenant_allowed_models,
    tenant_create,
    tenant_limits_update,
)
from tenants.types import Settlement
from tests.helpers import MODEL


def _period() -> str:
    return timezone.now().strftime("%Y-%m")


def _token_sum(scope: str, ident: int) -> int:
    return int(get_redis().get(limiter.Keys(tenant_id=0, api_key_id=0).tokens(scope, ident)[2]) or 0)


def _threaded(fn, n: int) -> list:
    def run(i):
        try:
            return fn(i)
        finally:
            connections.close_all()  # each worker thread has its own connection

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(run, range(n)))


@pytest.mark.django_db(transaction=True)
def test_reserve_and_settle_are_exact_under_concurrent_requests(world):
    tenant_limits_update(
        tenant=world.tenant_a,
        tokens_per_minute=10_000_000,
        max_concurrent_requests=8,
        monthly_token_quota=10**9,
    )
    auth = api_key_authenticate(raw_key=world.raw_key_a)
    start = threading.Barrier(8)

    def one_client(i: int) -> int:
        start.wait()
        charged = 0
        for j in range(10):
            reservation = admission_reserve(
                auth=auth, model=MODEL, prompt_tokens=10, max_tokens=90, request_id=f"r{i}-{j}"
            )
            completion = (i * 7 + j) % 90
            admission_settle(
                reservation=reservation, settlement=Settlement(prompt_tokens=10, completion_tokens=completion)
            )
            # A retried settle must not count twice.
            admission_settle(
                reservation=reservation, settlement=Settlement(prompt_tokens=10, completion_tokens=completion)
            )
            charged += 10 + completion
        return charged

    expected = sum(_threaded(one_client, 8))
    assert limiter.quota_counter_value(tenant_id=world.tenant_a.pk, period=_period()) == expected
    assert _token_sum("tenant", world.tenant_a.pk) == expected
    assert limiter.in_flight_count(tenant_id=world.tenant_a.pk) == 0


@pytest.mark.django_db(transaction=True)
def test_the_quota_admits_exactly_what_fits_under_contention(world):
    tenant_limits_update(tenant=world.tenant_a, monthly_token_quota=1000)
    auth = api_key_authenticate(raw_key=world.raw_key_a)

    def reserve(i: int) -> str:
        try:
            admission_reserve(auth=auth, model=MODEL, prompt_tokens=30, max_tokens=70, request_id=f"q{i}")
        except QuotaExceededError:
            return "refused"
        return "admitted"

    outcomes = _threaded(reserve, 24)
    assert outcomes.count("admitted") == 10
    assert outcomes.count("refused") == 14
    assert limiter.quota_counter_value(tenant_id=world.tenant_a.pk, period=_period()) == 1000


def test_settle_is_idempotent_and_releases_the_slot(world):
    tenant_limits_update(tenant=world.tenant_a, max_concurrent_requests=1, monthly_token_quota=500)
    auth = api_key_authenticate(raw_key=world.raw_key_a)
    reservation = admission_reserve(
        auth=auth, model=MODEL, prompt_tokens=20, max_tokens=80, request_id="once"
    )
    assert reservation.reserved_tokens == 100
    assert (reservation.tenant_id, reservation.api_key_id) == (world.tenant_a.pk, world.key_a.pk)
    admission_settle(reservation=reservation, settlement=Settlement(prompt_tokens=20, completion_tokens=5))
    admission_settle(reservation=reservation, settlement=Settlement(prompt_tokens=20, completion_tokens=80))
    assert limiter.quota_counter_value(tenant_id=world.tenant_a.pk, period=_period()) == 25
    assert limiter.in_flight_count(tenant_id=world.tenant_a.pk) == 0


def test_a_request_id_cannot_be_reserved_twice_while_in_flight(world):
    auth = api_key_authenticate(raw_key=world.raw_key_a)
    admission_reserve(auth=auth, model=MODEL, prompt_tokens=1, max_tokens=1, request_id="dup")
    with pytest.raises(InvalidRequestError) as caught:
        admission_reserve(auth=auth, model=MODEL, prompt_tokens=1, max_tokens=1, request_id="dup")
    assert caught.value.code == "duplicate_request_id"


def test_a_model_the_tenant_may_not_use_looks_exactly_like_a_missing_model(world):
    auth = api_key_authenticate(raw_key=world.raw_key_b)  # tenant B may use MODEL only
    errors = []
    for model in ("other-model", "no-such-model"):
        with pytest.raises(NotFoundError) as caught:
            admission_reserve(
                auth=auth, model=model, prompt_tokens=1, max_tokens=1, request_id=uuid.uuid4().hex
            )
        errors.append(caught.value.as_body()["error"] | {"message": caught.value.message.replace(model, "M")})
    assert errors[0] == errors[1]
    assert errors[0]["code"] == "model_not_found"
    assert errors[0]["param"] == "model"
    assert limiter.in_flight_count(tenant_id=world.tenant_b.pk) == 0
    model_access_check(auth=auth, model=MODEL)


def test_an_empty_model_list_means_no_model(db):
    tenant = tenant_create(name="Empty", slug="empty")
    _, raw_key = api_key_create(tenant=tenant, name="k")
    auth = api_key_authenticate(raw_key=raw_key)
    assert tenant_allowed_models(auth=auth) == []
    with pytest.raises(NotFoundError):
        model_access_check(auth=auth, model=MODEL)


def test_negative_token_counts_are_refused(world):
    auth = api_key_authenticate(raw_key=world.raw_key_a)
    with pytest.raises(InvalidRequestError) as caught:
        admission_reserve(auth=auth, model=MODEL, prompt_tokens=1, max_tokens=-1, request_id="neg")
    assert caught.value.param == "max_tokens"
