"""The generation lifecycle: aborts when the client goes away, settlement, engine death."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from inference.services import ChoiceDelta, Generation, chat_plan_create, new_request_id
from tenants.models import UsageRecord
from tenants.services import api_key_authenticate
from tests.inference.conftest import make_world

pytestmark = pytest.mark.django_db(transaction=True)


async def _generation(world, **extra) -> Generation:
    auth = await sync_to_async(api_key_authenticate)(raw_key=world.raw_key_a)
    data = {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
    plan = await sync_to_async(chat_plan_create)(auth=auth, data=data, request_id=new_request_id())
    return Generation(auth=auth, plan=plan)


async def test_a_generation_closed_mid_stream_signals_abort_and_bills_only_produced_tokens(world):
    from engine.protocol import DeltaOutput, Event

    await world.engine.heartbeat()
    generation = await _generation(world)
    events = generation.run()
    assert await anext(events) is None  # admitted and queued
    request = await world.engine.next_request()
    await world.engine.emit(request.request_id, Event.delta([DeltaOutput(0, "ab", [3, 4])]))
    first = await anext(events)
    assert isinstance(first, ChoiceDelta) and first.token_ids == [3, 4]

    await events.aclose()  # what the SSE response does when the client disconnects

    assert await world.engine.cancels() == [request.request_id]
    row = await UsageRecord.objects.aget(request_id=generation.plan.request_id)
    assert (row.status, row.completion_tokens, row.prompt_tokens) == ("cancelled", 2, len(request.prompt_token_ids))


async def test_a_cancelled_task_still_settles_once(world):
    await world.engine.heartbeat()
    generation = await _generation(world)
    events = generation.run()
    await anext(events)

    async def drain():
        async for _ in events:
            pass

    task = asyncio.create_task(drain())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await UsageRecord.objects.filter(request_id=generation.plan.request_id).acount() == 1
    assert (await UsageRecord.objects.aget(request_id=generation.plan.request_id)).status == "cancelled"


async def test_the_stream_fails_instead_of_hanging_when_every_replica_is_gone(world):
    await world.engine.heartbeat()
    served = asyncio.create_task(world.engine.next_request())
    response_task = asyncio.create_task(
        AsyncClient().post(
            "/v1/chat/completions",
            json.dumps({"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "stream": True}),
            content_type="application/json",
            headers=world.headers(),
        )
    )
    await served
    response = await response_task
    await world.engine.stop_heartbeat()  # the replica died before producing anything
    raw = b"".join([c async for c in response.streaming_content]).decode()
    events = [e[6:] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
    row = await UsageRecord.objects.aget(request_id=response["x-request-id"])
    assert (row.status, row.completion_tokens) == ("error", 0)


async def test_rate_limit_is_429_with_headers_and_nothing_queued(transactional_db, served_model_dir):
    world = await sync_to_async(make_world)(model_dir=served_model_dir, requests_per_minute=1)
    await world.engine.heartbeat()
    body = json.dumps({"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    served = asyncio.create_task(world.engine.serve_one([("a", [1])]))
    ok = await AsyncClient().post("/v1/chat/completions", body, content_type="application/json", headers=world.headers())
    await served
    assert ok.status_code == 200
    assert ok["x-ratelimit-limit-requests"] == "1"

    refused = await AsyncClient().post(
        "/v1/chat/completions", body, content_type="application/json", headers=world.headers()
    )

    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused["retry-after"]) >= 1
    assert refused["x-ratelimit-remaining-requests"] == "0"
    assert refused["x-request-id"]
    assert await world.engine.queued_count() == 1
    assert await UsageRecord.objects.acount() == 1
