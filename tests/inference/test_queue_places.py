"""Queue places are taken all at once or not at all, and a request cancelled while it takes them
leaves none held (a leaked place would count against the model's and the tenant's bounds for an
hour)."""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings

from core.redis_client import get_async_redis
from inference.gateway.queue_bounds import queue_place_release, queue_place_take

MODEL, TENANT = "queue-places-model", "queue-places-tenant"


@pytest.fixture(autouse=True)
async def _no_places_before():
    prefix = settings.REDIS_PREFIX
    await get_async_redis().delete(f"{prefix}queued:{MODEL}", f"{prefix}queued:{MODEL}:tenant:{TENANT}")


async def _held() -> tuple[int, int]:
    redis = get_async_redis()
    prefix = settings.REDIS_PREFIX
    return (
        await redis.zcard(f"{prefix}queued:{MODEL}"),
        await redis.zcard(f"{prefix}queued:{MODEL}:tenant:{TENANT}"),
    )


async def test_a_request_cancelled_while_it_takes_its_places_leaves_none_held():
    # A request of many prompts (each its own engine request) is cancelled at every point of its
    # take in turn, until the take is over before the cancel comes.
    ids = [f"req-{i}" for i in range(40)]
    cancelled = 0
    for yields in range(10_000):
        take = asyncio.ensure_future(
            queue_place_take(model=MODEL, tenant=TENANT, request_ids=ids, model_max=100, tenant_max=100)
        )
        for _ in range(yields):
            await asyncio.sleep(0)
        over = take.done()
        take.cancel()
        try:
            result = await take
        except asyncio.CancelledError:
            cancelled += 1
            assert await _held() == (0, 0), f"places left held after a cancel at yield {yields}"
            continue
        assert result is None  # the take went through before the cancel landed: it holds them all
        assert await _held() == (40, 40)
        await queue_place_release(model=MODEL, tenant=TENANT, request_ids=ids)
        if over:
            break
    else:
        pytest.fail("the take never finished")
    assert cancelled >= 1  # at least the cancel before it started
    assert await _held() == (0, 0)


async def test_a_request_takes_all_its_places_or_none():
    assert (
        await queue_place_take(
            model=MODEL, tenant=TENANT, request_ids=["a", "b"], model_max=3, tenant_max=None
        )
        is None
    )

    full = await queue_place_take(
        model=MODEL, tenant=TENANT, request_ids=["c", "d"], model_max=3, tenant_max=None
    )

    assert full is not None and full.scope == "model" and full.held == 2
    assert await _held() == (2, 2)  # c was not taken on its own
    full = await queue_place_take(
        model=MODEL, tenant=TENANT, request_ids=["c", "d"], model_max=None, tenant_max=3
    )
    assert full is not None and full.scope == "tenant" and full.held == 2
    assert await _held() == (2, 2)
    await queue_place_release(model=MODEL, tenant=TENANT, request_ids=["a", "b"])
    assert await _held() == (0, 0)
