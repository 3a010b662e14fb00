"""A model scaled to zero: with the deployment's replica_wait_seconds, a request for a model with no
ready replica waits, queued where an autoscaler sees it, for one to start; past the wait it is a 503
engine_unavailable, billed nothing, and the replica that starts later never runs it."""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from inference.gateway.queue_depth import QueueDepth, queue_depth
from tenants.models import UsageRecord
from tests.e2e.settlement import engine_events
from tests.helpers import api_post, async_wait_until
from tests.inference.conftest import queued_requests, running_engine_worker

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/chat/completions"


def _chat(world) -> dict:
    return {
        "model": world.model,
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 4,
        "temperature": 0,
    }


async def _depth(model: str) -> QueueDepth:
    return await sync_to_async(queue_depth)(model)


async def _wait_seconds(world, seconds: int) -> None:
    world.deployment.replica_wait_seconds = seconds
    await world.deployment.asave(update_fields=["replica_wait_seconds"])


async def test_a_request_waits_queued_for_the_first_replica_and_is_answered_by_it(world, operator_headers):
    await _wait_seconds(world, 120)
    request = asyncio.ensure_future(api_post(world, URL, _chat(world)))

    # Queued where KEDA's trigger and the gauge see it; the web tier still counts itself ready.
    async def queued() -> bool:
        return await _depth(world.model) == QueueDepth(waiting=1, pending=0)

    await async_wait_until(queued, timeout=30, what="the request to be queued")
    ready = await AsyncClient().get("/ready", headers=operator_headers)
    assert ready.status_code == 200 and ready.json()["models"][world.model]["ready"] is False
    assert not request.done()

    with running_engine_worker(world):
        response = await asyncio.wait_for(request, timeout=120)

    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    [row] = await sync_to_async(list)(UsageRecord.objects.all())
    assert (row.status, row.prompt_tokens > 0, row.completion_tokens > 0) == ("success", True, True)


async def test_past_the_wait_it_is_a_503_billed_nothing_and_a_later_replica_never_runs_it(world):
    await _wait_seconds(world, 1)
    started = time.monotonic()

    response = await api_post(world, URL, _chat(world))

    assert time.monotonic() - started >= 1.0
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
    [row] = await sync_to_async(list)(UsageRecord.objects.all())
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("error", 0, 0)
    [queued] = await queued_requests(world.model)
    assert queued.deadline is not None and queued.deadline <= time.time()

    with running_engine_worker(world):
        # The replica takes the entry and drops it unstarted: it is past its deadline (and cancelled).
        async def taken() -> bool:
            return await _depth(world.model) == QueueDepth(waiting=0, pending=0)

        await async_wait_until(taken, timeout=30, what="the replica to take the entry")
    assert not any(event.type == "delta" for event in engine_events(queued.request_id))


async def test_without_a_wait_a_model_with_no_replica_is_refused_at_once(world):
    response = await api_post(world, URL, _chat(world))

    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
    assert await queued_requests(world.model) == []
