"""Service tiers, fair-share weights, bounded queues and queue deadlines through the REST API, with
a real engine replica of the tiny model behind it."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from inference.gateway.queue_bounds import (
    DRAIN_WINDOW_S,
    queue_place_release,
    queue_place_take,
    retry_after,
)
from tenants.models import UsageRecord
from tenants.ratelimit.limiter import in_flight_count
from tests.helpers import api_post, sse_events
from tests.inference.conftest import queued_requests, running_engine_worker

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/chat/completions"


def body(world, **extra) -> dict:
    return {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}


async def ledger() -> list[UsageRecord]:
    return await sync_to_async(list)(UsageRecord.objects.order_by("created_at"))


@pytest.mark.world(tenant_a={"service_tiers": ["default", "flex", "priority"], "fair_share_weight": 3})
@pytest.mark.parametrize(
    ("asked", "tier", "priority"),
    [("priority", "priority", 0), ("flex", "flex", 2), ("auto", "default", 1), (None, "default", 1)],
)
async def test_a_tier_the_tenant_may_use_runs_at_its_priority_and_is_recorded(
    world, engine_worker, asked, tier, priority
):
    extra = {} if asked is None else {"service_tier": asked}
    response = await api_post(world, URL, body(world, **extra))

    assert response.status_code == 200, response.content
    assert response.json()["service_tier"] == tier
    [request] = await queued_requests(world.model)
    assert (request.priority, request.weight) == (priority, 3.0)
    [row] = await ledger()
    assert row.service_tier == tier and row.status == "success"


async def test_streamed_chunks_name_the_tier(world, engine_worker):
    response = await api_post(world, URL, body(world, stream=True, service_tier="flex"))
    chunks = [
        json.loads(e[len("data: ") :])
        for e in b"".join([c async for c in response.streaming_content]).decode().split("\n\n")
        if e.startswith("data: {")
    ]
    assert chunks and all(c["service_tier"] == "flex" for c in chunks)


@pytest.mark.parametrize(
    ("asked", "code"), [("priority", "service_tier_unavailable"), ("platinum", "invalid_request_error")]
)
async def test_a_tier_not_enabled_for_the_tenant_is_a_clear_400(world, engine_worker, asked, code):
    response = await api_post(world, URL, body(world, service_tier=asked))

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "service_tier"
    assert code in (error["code"], error["type"])
    if asked == "priority":
        assert "enabled: default, flex" in error["message"]
    assert await queued_requests(world.model) == []
    assert await ledger() == []


@pytest.mark.world(deployment={"max_queued_requests": 2})
async def test_a_full_model_queue_is_a_429_with_retry_after_and_takes_nothing(world, engine_worker):
    tenant = world.tenant_b.slug  # another tenant's requests, waiting to start on this model
    assert (
        await queue_place_take(
            model=world.model, tenant=tenant, request_ids=["w1", "w2"], model_max=2, tenant_max=None
        )
        is None
    )

    response = await api_post(world, URL, body(world))

    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_full"
    assert 1 <= int(response["retry-after"]) <= 60
    assert await queued_requests(world.model) == []
    assert await ledger() == []  # refused before admission: nothing reserved or billed
    assert await sync_to_async(in_flight_count)(tenant_id=world.tenant_a.pk) == 0

    await queue_place_release(model=world.model, tenant=tenant, request_ids=["w1"], started=True)
    response = await api_post(world, URL, body(world))
    assert response.status_code == 200, response.content


@pytest.mark.world(tenant_a={"max_queued_requests": 1})
async def test_a_tenant_over_its_own_queue_bound_is_refused_while_others_pass(world, engine_worker):
    tenant = world.tenant_a.slug
    assert (
        await queue_place_take(
            model=world.model, tenant=tenant, request_ids=["mine"], model_max=None, tenant_max=1
        )
        is None
    )

    response = await api_post(world, URL, body(world))

    assert response.status_code == 429
    assert "your organization's queue" in response.json()["error"]["message"]
    # Another tenant's place on the same model is not counted against A.
    assert (
        await queue_place_take(
            model=world.model, tenant="someone-else", request_ids=["theirs"], model_max=None, tenant_max=1
        )
        is None
    )


async def test_a_served_request_gives_its_place_back(world, engine_worker):
    from django.conf import settings

    from core.redis_client import get_async_redis

    response = await api_post(world, URL, body(world))
    assert response.status_code == 200
    redis = get_async_redis()
    assert await redis.zcard(f"{settings.REDIS_PREFIX}queued:{world.model}") == 0
    assert await redis.zcard(f"{settings.REDIS_PREFIX}starts:{world.model}") == 1


async def test_a_streams_first_token_does_not_wait_for_its_place_to_be_given_back(
    world, engine_worker, monkeypatch
):
    """An engine request's place is given back when its first event comes, by a task of its own:
    the first token goes to the client without waiting for that round trip (here held back until the
    token has come), and the place is given back all the same."""
    from django.conf import settings

    from core.redis_client import get_async_redis
    from inference.services import generation

    gate, real_release = asyncio.Event(), generation.queue_place_release

    async def release_after_the_gate(**kwargs) -> None:
        await gate.wait()
        await real_release(**kwargs)

    monkeypatch.setattr(generation, "queue_place_release", release_after_the_gate)
    response = await api_post(world, URL, body(world, stream=True))
    assert response.status_code == 200
    chunks = aiter(response.streaming_content)
    deltas: list[dict] = []
    while not any(d.get("content") for d in deltas):
        for event in sse_events(await asyncio.wait_for(anext(chunks), timeout=60)):
            deltas.extend(c["delta"] for c in json.loads(event)["choices"])
    redis = get_async_redis()
    assert await redis.zcard(f"{settings.REDIS_PREFIX}queued:{world.model}") == 1  # not given back yet
    gate.set()
    rest = sse_events(b"".join([chunk async for chunk in chunks]))
    assert rest[-1] == "[DONE]"
    assert await redis.zcard(f"{settings.REDIS_PREFIX}queued:{world.model}") == 0
    assert await redis.zcard(f"{settings.REDIS_PREFIX}starts:{world.model}") == 1


async def test_places_bounds_and_retry_after_in_redis(world):
    model, full = world.model, None
    for i in range(3):
        full = await queue_place_take(
            model=model, tenant="t", request_ids=[f"r{i}"], model_max=2, tenant_max=None
        )
    assert full is not None and full.scope == "model" and full.held == 2
    assert full.retry_after_s == 60  # nothing started lately: the longest wait
    # A request of two prompts takes two places or none.
    await queue_place_release(model=model, tenant="t", request_ids=["r0"], started=True)
    assert (
        await queue_place_take(model=model, tenant="t", request_ids=["a", "b"], model_max=2, tenant_max=None)
    ) is not None
    assert (
        await queue_place_take(model=model, tenant="t", request_ids=["a"], model_max=2, tenant_max=None)
        is None
    )
    assert retry_after(starts_in_window=DRAIN_WINDOW_S * 2, ahead=10) == 5  # 2 starts a second
    assert retry_after(starts_in_window=DRAIN_WINDOW_S * 100, ahead=1) == 1


async def post_with_read_timeout(world, seconds: str):
    """A request whose SDK says it waits `seconds` (x-stainless-read-timeout)."""
    return await AsyncClient().post(
        URL,
        json.dumps(body(world)),
        content_type="application/json",
        headers={**world.headers(), "x-stainless-read-timeout": seconds},
    )


async def test_a_request_past_its_timeout_before_it_is_queued_never_reaches_an_engine(world):
    """A timeout counts from the request's arrival: one that has passed before the request is queued
    (here a microsecond, gone while the body is planned) is answered 503 `queue_timeout` by the web
    process, billed nothing, and no replica is asked to start it."""
    with running_engine_worker(world) as worker:
        engine = worker.engine
        seen = engine.num_prompt_tokens
        response = await post_with_read_timeout(world, "0.000001")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "queue_timeout"
        assert engine.num_prompt_tokens == seen
        assert await queued_requests(world.model) == []
        # The next request with room in its timeout is served as ever.
        served = await api_post(world, URL, body(world))
        assert served.status_code == 200
        assert engine.num_prompt_tokens > seen
        assert len(await queued_requests(world.model)) == 1

    rows = await ledger()
    [dropped] = [r for r in rows if r.status == "error"]
    assert (dropped.prompt_tokens, dropped.completion_tokens) == (0, 0)
    assert await sync_to_async(in_flight_count)(tenant_id=world.tenant_a.pk) == 0


async def test_a_request_past_its_timeout_in_the_queue_is_dropped_and_billed_nothing(world):
    with running_engine_worker(world, max_num_seqs=1):
        # A long stream takes the replica's only sequence slot ...
        busy = await api_post(world, URL, body(world, max_tokens=200, ignore_eos=True, stream=True))
        chunks = busy.streaming_content.__aiter__()
        first = await anext(chunks)
        assert b"delta" in first
        # ... so a request that may wait 50 ms to start finds none free in time.
        response = await post_with_read_timeout(world, "0.05")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "queue_timeout"
        rest = b"".join([c async for c in chunks])
        assert rest.endswith(b"data: [DONE]\n\n")

    rows = await ledger()
    [dropped] = [r for r in rows if r.status == "error"]
    assert (dropped.prompt_tokens, dropped.completion_tokens) == (0, 0)
    assert [r.status for r in rows].count("success") == 1
    assert await sync_to_async(in_flight_count)(tenant_id=world.tenant_a.pk) == 0
