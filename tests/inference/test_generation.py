"""The generation lifecycle against a real engine replica: aborts when the client goes away,
settlement, rate limits; and a replica that vanishes (injected)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from core.errors import PlatformError
from core.redis_client import get_async_redis
from core.request_ids import new_request_id
from engine.protocol import DeltaOutput, Event, FinishedOutput, Usage, cancel_request_id, cancel_stream
from inference import metrics
from inference.services import ChoiceDelta, ChoiceFinished, Generation, generation_start
from tenants.models import UsageRecord
from tenants.services import api_key_authenticate
from tests.inference.conftest import engine_idle, queued_requests, running_engine_worker
from tests.inference.fault_injection import ProtocolFaultInjector

pytestmark = pytest.mark.django_db(transaction=True)


async def _start(world, **extra) -> tuple[Generation, AsyncIterator]:
    """A chat generation admitted and queued, as the REST views and the websocket start one."""
    auth = await sync_to_async(api_key_authenticate)(raw_key=world.raw_key_a)
    data = {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, **extra}
    return await generation_start(auth=auth, kind="chat", data=data, request_id=new_request_id())


async def _cancels(world) -> list[str]:
    from django.conf import settings

    entries = await get_async_redis().xrange(cancel_stream(settings.REDIS_PREFIX, world.model))
    return [cancel_request_id(fields) for _, fields in entries]


async def test_a_generation_closed_mid_stream_signals_abort_and_bills_only_delivered_tokens(
    world, engine_worker
):
    generation, events = await _start(world, max_tokens=200, ignore_eos=True)
    first = await anext(events)
    assert isinstance(first, ChoiceDelta) and first.token_ids

    await events.aclose()  # what the SSE response does when the client disconnects

    [request] = await queued_requests(world.model)
    assert await _cancels(world) == [request.request_id] == [generation.plan.request_id]
    row = await UsageRecord.objects.aget(request_id=generation.plan.request_id)
    assert (row.status, row.completion_tokens, row.prompt_tokens) == (
        "cancelled",
        len(first.token_ids),
        len(request.prompt_token_ids),
    )
    stats = await engine_idle(engine_worker)
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_total_blocks)


async def test_a_cancelled_task_still_settles_once(world, engine_worker):
    generation, events = await _start(world, max_tokens=200, ignore_eos=True)
    first_token = asyncio.Event()

    async def drain():
        async for item in events:
            if isinstance(item, ChoiceDelta):
                first_token.set()

    task = asyncio.create_task(drain())
    await asyncio.wait_for(first_token.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    rows = await sync_to_async(list)(UsageRecord.objects.filter(request_id=generation.plan.request_id))
    assert [r.status for r in rows] == ["cancelled"]
    assert 1 <= rows[0].completion_tokens < 200
    assert await _cancels(world) == [generation.plan.request_id]
    assert (await engine_idle(engine_worker)).num_running == 0


async def test_the_stream_fails_instead_of_hanging_when_every_replica_is_gone(world):
    await world.faults.heartbeat()
    taken = asyncio.create_task(world.faults.next_request())
    response_task = asyncio.create_task(
        AsyncClient().post(
            "/v1/chat/completions",
            json.dumps(
                {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
            ),
            content_type="application/json",
            headers=world.headers(),
        )
    )
    await taken
    response = await response_task
    await world.faults.vanish()  # the replica died before producing anything
    raw = b"".join([c async for c in response.streaming_content]).decode()
    events = [e[6:] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
    row = await UsageRecord.objects.aget(request_id=response["x-request-id"])
    assert (row.status, row.completion_tokens) == ("error", 0)


def _delta(token: int, text: str, replica: str | None = None) -> Event:
    event = Event.delta([DeltaOutput(index=0, text=text, token_ids=[token])])
    event.replica = replica
    return event


async def _streaming_on(replica: ProtocolFaultInjector, world, *, max_tokens: int):
    """A streaming generation held by `replica` (live), which has sent it one token: the
    generation, its events, the engine request, and the first delta."""
    await replica.heartbeat()
    generation, events = await _start(world, max_tokens=max_tokens, stream=True)
    request = await replica.next_request()
    await replica.emit(request.request_id, _delta(5, "a", replica=replica.replica_id))
    return generation, events, request, await anext(events)


async def _wait_orphaned(generation: Generation) -> None:
    """Until the generation has found its replica gone (and, with failover, waits for another)."""
    deadline = asyncio.get_running_loop().time() + 10
    while not generation._orphaned_at:
        assert asyncio.get_running_loop().time() < deadline, "the generation never saw its replica gone"
        await asyncio.sleep(0.05)


async def test_a_stream_whose_replica_vanished_goes_on_when_another_takes_it_over(world):
    lost, taker = world.faults, ProtocolFaultInjector(world.model, replica_id="fault-injector-2")
    generation, events, request, first = await _streaming_on(lost, world, max_tokens=2)
    gaps_before = metrics.STREAM_FAILOVER_GAP.labels(world.model)._sum.get()

    await taker.heartbeat()
    await lost.vanish()
    reading = asyncio.ensure_future(anext(events))
    await _wait_orphaned(generation)  # without failover, the stream would fail here
    await taker.emit(request.request_id, Event.failover(taker.replica_id))
    await taker.emit(request.request_id, _delta(6, "b"))
    await taker.emit(
        request.request_id,
        Event.finished([FinishedOutput(0, "length")], Usage(len(request.prompt_token_ids), 2)),
    )
    rest = [await reading] + [item async for item in events]

    assert (first.text, [(r.text, r.token_ids) for r in rest[:1]]) == ("a", [("b", [6])])
    assert isinstance(rest[1], ChoiceFinished) and rest[1].finish_reason == "length"
    assert generation.failovers == 1 and not generation._orphaned_at
    assert metrics.STREAM_FAILOVER_GAP.labels(world.model)._sum.get() > gaps_before
    row = await UsageRecord.objects.aget(request_id=generation.plan.request_id)
    assert (row.status, row.completion_tokens) == ("success", 2)


async def test_a_stream_whose_replica_vanished_fails_when_none_takes_it_over_in_time(world, settings):
    settings.FAILOVER_WAIT_S = 1.0
    lost, other = world.faults, ProtocolFaultInjector(world.model, replica_id="fault-injector-2")
    await other.heartbeat()  # live, but it never takes the request over
    generation, events, request, _ = await _streaming_on(lost, world, max_tokens=5)

    await lost.vanish()
    with pytest.raises(PlatformError) as caught:
        await anext(events)

    assert caught.value.code == "engine_unavailable"
    assert "no other replica took it over" in str(caught.value)
    row = await UsageRecord.objects.aget(request_id=generation.plan.request_id)
    assert (row.status, row.completion_tokens) == ("error", 1)
    assert await _cancels(world) == [request.request_id]


async def test_with_failovers_off_a_stream_whose_replica_vanished_fails_at_once(world, settings):
    settings.MAX_FAILOVERS = 0
    settings.FAILOVER_WAIT_S = 600.0
    lost = world.faults
    _, events, _, _ = await _streaming_on(lost, world, max_tokens=5)

    await lost.vanish()
    with pytest.raises(PlatformError) as caught:
        await asyncio.wait_for(anext(events), timeout=30)

    assert caught.value.code == "engine_unavailable"
    assert str(caught.value) == "The engine replica serving this request stopped."


@pytest.mark.world(tenant_a={"requests_per_minute": 1})
async def test_rate_limit_is_429_with_headers_and_nothing_queued(world):
    body = json.dumps(
        {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    with running_engine_worker(world):
        ok = await AsyncClient().post(
            "/v1/chat/completions", body, content_type="application/json", headers=world.headers()
        )
        refused = await AsyncClient().post(
            "/v1/chat/completions", body, content_type="application/json", headers=world.headers()
        )
        # Read while the replica runs: the stream of its own goes with it when it leaves.
        queued = [r.request_id for r in await queued_requests(world.model)]

    assert ok.status_code == 200
    assert ok["x-ratelimit-limit-requests"] == "1"
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused["retry-after"]) >= 1
    assert refused["x-ratelimit-remaining-requests"] == "0"
    assert refused["x-request-id"]
    assert queued == [ok["x-request-id"]]
    assert await sync_to_async(list)(UsageRecord.objects.values_list("request_id", "status")) == [
        (ok["x-request-id"], "success")
    ]
