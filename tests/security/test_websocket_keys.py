"""The websocket holds to the same key rules as REST: the key is never echoed in the handshake, a
socket that never authenticates is closed, and every stream start checks the key again."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from config.asgi import application
from inference.services import generation as generation_module
from tenants.models import UsageRecord
from tenants.ratelimit import limiter
from tenants.services import api_key_revoke, api_key_rotate, tenant_set_active
from tests.helpers import async_wait_until
from tests.inference.conftest import queued_requests

pytestmark = pytest.mark.django_db(transaction=True)


def _chat(stream_id: str, model: str, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}
    return {"type": "chat", "id": stream_id, "request": body}


@pytest.fixture
def held_admission(monkeypatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Admission (the reservation) waits in its thread until `release` is set; `entered` is set
    once a request has reached it."""
    entered, release = threading.Event(), threading.Event()
    reserve = generation_module.admission_reserve

    def held(**kwargs):
        entered.set()
        assert release.wait(30)
        return reserve(**kwargs)

    monkeypatch.setattr(generation_module, "admission_reserve", held)
    yield entered, release
    release.set()


async def _authenticated(world) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(application, "/ws/v1/chat", subprotocols=["pagoda.v1"])
    connected, subprotocol = await communicator.connect()
    assert (connected, subprotocol) == (True, "pagoda.v1")
    await communicator.send_json_to({"type": "auth", "api_key": world.raw_key_a})
    assert await communicator.receive_json_from(timeout=10) == {"type": "authenticated"}
    return communicator


@pytest.mark.parametrize("offered", [["pagoda.bearer.{key}"], ["chat", "pagoda.bearer.{key}"], []])
async def test_a_handshake_without_pagoda_v1_is_refused_and_never_echoes_the_key(world, offered):
    offered = [p.format(key=world.raw_key_a) for p in offered]
    communicator = WebsocketCommunicator(application, "/ws/v1/chat", subprotocols=offered)

    connected, answer = await communicator.connect()

    assert connected is False
    assert world.raw_key_a not in str(answer)


async def test_a_socket_that_never_authenticates_is_closed(world, settings):
    settings.WEBSOCKET_AUTH_TIMEOUT = 0.3
    communicator = WebsocketCommunicator(application, "/ws/v1/chat", subprotocols=["pagoda.v1"])
    assert (await communicator.connect())[0]

    message = await communicator.receive_json_from(timeout=10)

    assert (message["type"], message["error"]["code"]) == ("error", "invalid_api_key")
    assert (await communicator.receive_output(timeout=10))["code"] == 4401


async def test_an_authenticated_socket_is_not_closed_by_the_auth_timeout(world, settings, engine_worker):
    settings.WEBSOCKET_AUTH_TIMEOUT = 0.3
    communicator = await _authenticated(world)
    await asyncio.sleep(0.6)  # a passage of time, not a synchronisation: past the auth deadline
    await communicator.send_json_to(_chat("s1", world.model))
    kinds = []
    while not kinds or kinds[-1] not in ("done", "error"):
        kinds.append((await communicator.receive_json_from(timeout=60))["type"])
    assert kinds[-1] == "done"
    await communicator.disconnect()


@pytest.mark.parametrize(
    ("how", "code"),
    [
        ("revoked", "invalid_api_key"),
        ("tenant deactivated", "tenant_inactive"),
        ("secret rotated without grace", "invalid_api_key"),
    ],
)
async def test_a_stream_started_after_the_key_lost_its_rights_is_refused(world, how, code):
    communicator = await _authenticated(world)
    if how == "revoked":
        await sync_to_async(api_key_revoke)(api_key=world.key_a)
    elif how == "tenant deactivated":
        await sync_to_async(tenant_set_active)(tenant=world.tenant_a, active=False)
    else:
        await sync_to_async(api_key_rotate)(api_key=world.key_a, grace=timedelta(0))

    await communicator.send_json_to(_chat("s1", world.model))

    message = await communicator.receive_json_from(timeout=10)
    assert (message["type"], message["id"], message["error"]["code"]) == ("error", "s1", code)
    assert (await communicator.receive_output(timeout=10))["code"] == 4401
    assert await queued_requests(world.model) == []
    assert not await UsageRecord.objects.aexists()


async def test_a_cancel_during_admission_is_answered_and_gives_everything_back(
    world, held_admission, engine_worker
):
    entered, release = held_admission
    communicator = await _authenticated(world)

    await communicator.send_json_to(_chat("s1", world.model))
    assert await asyncio.to_thread(entered.wait, 30)
    await communicator.send_json_to({"type": "cancel", "id": "s1"})
    cancelled = await communicator.receive_json_from(timeout=10)
    release.set()

    assert cancelled == {
        "type": "cancelled",
        "id": "s1",
        "usage": {
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "total_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }

    # The reservation completes in its thread, then is given back: poll until it has been.
    async def settled() -> UsageRecord | None:
        row = await UsageRecord.objects.filter(tenant_id=world.tenant_a.pk).afirst()
        return row if row is not None and limiter.in_flight_count(tenant_id=world.tenant_a.pk) == 0 else None

    row = await async_wait_until(settled, timeout=30, what="the cancelled reservation to be given back")
    assert row is not None and (row.status, row.prompt_tokens, row.completion_tokens) == ("cancelled", 0, 0)
    assert limiter.in_flight_count(tenant_id=world.tenant_a.pk) == 0
    assert await UsageRecord.objects.acount() == 1
    assert await queued_requests(world.model) == []
    await communicator.disconnect()


async def test_one_streams_blocking_work_does_not_stall_other_sockets(world, held_admission, engine_worker):
    entered, release = held_admission
    first = await _authenticated(world)
    await first.send_json_to(_chat("s1", world.model))
    assert await asyncio.to_thread(entered.wait, 30)
    try:
        # While the first stream's admission is held, another socket is served end to end.
        second = await _authenticated(world)
        await second.send_json_to({"type": "bogus", "id": "x"})
        answer = await second.receive_json_from(timeout=10)
        assert (answer["type"], answer["error"]["param"]) == ("error", "type")
    finally:
        release.set()
    kinds = []
    while not kinds or kinds[-1] not in ("done", "error"):
        kinds.append((await first.receive_json_from(timeout=60))["type"])
    assert kinds[-1] == "done"
    await first.disconnect()
    await second.disconnect()


@pytest.mark.world(tenant_a={"max_concurrent_requests": 1})
async def test_the_tenants_concurrency_limit_covers_websocket_and_rest_together(
    world, engine_worker, settings
):
    from tests.helpers import api_post

    # Refusals answered at once (their hold has its own tests): the first stream must still hold the
    # slot when the second is refused.
    settings.RATE_LIMIT_HOLD_S = 0.0
    communicator = await _authenticated(world)
    await communicator.send_json_to(_chat("s1", world.model, max_tokens=200, ignore_eos=True))
    first = await communicator.receive_json_from(timeout=60)
    assert first["type"] == "delta"  # the stream holds the tenant's one slot

    rest = await api_post(
        world,
        "/v1/chat/completions",
        {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    await communicator.send_json_to(_chat("s2", world.model, max_tokens=2))
    second = await communicator.receive_json_from(timeout=60)
    while second["id"] != "s2":
        second = await communicator.receive_json_from(timeout=60)

    assert rest.status_code == 429 and rest.json()["error"]["code"] == "rate_limit_exceeded"
    assert "concurrent" in rest.json()["error"]["message"]
    assert (second["type"], second["error"]["code"]) == ("error", "rate_limit_exceeded")
    await communicator.send_json_to({"type": "cancel", "id": "s1"})
    await communicator.disconnect()
