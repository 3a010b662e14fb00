"""`/ws/v1/chat` through Channels' communicator, answered by a real engine worker (the tiny model's
LLMEngine and the Redis loop, in a thread of this process)."""

from __future__ import annotations

import json

import pytest
from channels.testing import WebsocketCommunicator

from config.asgi import application
from tenants.models import UsageRecord
from tests.inference.conftest import engine_idle, queued_requests

pytestmark = pytest.mark.django_db(transaction=True)


async def _connect(subprotocols: list[str] | None = None) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(
        application, "/ws/v1/chat", subprotocols=subprotocols or ["pagoda.v1"]
    )
    connected, _ = await communicator.connect()
    assert connected
    return communicator


def _chat(stream_id: str, model: str, **extra) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "temperature": 0,
        **extra,
    }
    return {"type": "chat", "id": stream_id, "request": body}


async def _until_done(
    communicator: WebsocketCommunicator, ids: set[str], timeout: float = 60
) -> dict[str, list[dict]]:
    """Messages per stream id until each of `ids` has ended (done, error or cancelled)."""
    messages: dict[str, list[dict]] = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        message = await communicator.receive_json_from(timeout=timeout)
        messages.setdefault(message.get("id"), []).append(message)
        if message["type"] in ("done", "error", "cancelled"):
            open_ids.discard(message.get("id"))
    return messages


async def test_a_key_offered_as_subprotocol_authenticates_and_is_never_echoed(world, engine_worker):
    communicator = WebsocketCommunicator(
        application, "/ws/v1/chat", subprotocols=["pagoda.v1", f"pagoda.bearer.{world.raw_key_a}"]
    )
    connected, subprotocol = await communicator.connect()

    assert connected and subprotocol == "pagoda.v1"
    assert await communicator.receive_json_from(timeout=10) == {"type": "authenticated"}
    await communicator.disconnect()


async def test_a_bad_key_in_the_first_message_is_refused_and_the_socket_closed(world):
    communicator = await _connect()
    await communicator.send_json_to({"type": "auth", "api_key": "sk-not-a-real-key"})

    message = await communicator.receive_json_from(timeout=10)
    assert message["type"] == "error"
    assert message["error"]["code"] == "invalid_api_key"
    assert (await communicator.receive_output(timeout=10))["code"] == 4401
    assert not await UsageRecord.objects.aexists()


async def test_chat_before_auth_is_an_error_and_nothing_is_queued(world):
    communicator = await _connect()
    await communicator.send_json_to(_chat("s1", world.model))

    message = await communicator.receive_json_from(timeout=10)
    assert message["type"] == "error" and message["error"]["code"] == "invalid_api_key"
    assert "Authenticate first" in message["error"]["message"]
    assert await queued_requests(world.model) == []
    await communicator.disconnect()


async def test_two_streams_on_one_connection_each_get_their_deltas_and_usage(world, engine_worker):
    communicator = await _connect()
    await communicator.send_json_to({"type": "auth", "api_key": world.raw_key_a})
    assert (await communicator.receive_json_from(timeout=10))["type"] == "authenticated"

    await communicator.send_json_to(_chat("a", world.model, max_tokens=12, ignore_eos=True))
    await communicator.send_json_to(_chat("b", world.model, max_tokens=5, ignore_eos=True))
    messages = await _until_done(communicator, {"a", "b"})

    for stream_id, max_tokens in (("a", 12), ("b", 5)):
        deltas = [m for m in messages[stream_id] if m["type"] == "delta"]
        done = messages[stream_id][-1]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == max_tokens
        assert deltas and all(m["index"] == 0 for m in deltas)
    rows = [r async for r in UsageRecord.objects.order_by("completion_tokens")]
    assert [(r.status, r.completion_tokens) for r in rows] == [("success", 5), ("success", 12)]
    await communicator.disconnect()


async def test_streamed_text_equals_the_rest_answer_under_greedy(world, engine_worker):
    from django.test import AsyncClient

    rest = await AsyncClient().post(
        "/v1/chat/completions",
        json.dumps(_chat("x", world.model, max_tokens=10)["request"]),
        content_type="application/json",
        headers=world.headers(),
    )
    assert rest.status_code == 200
    communicator = await _connect(["pagoda.v1", f"pagoda.bearer.{world.raw_key_a}"])
    assert (await communicator.receive_json_from(timeout=10))["type"] == "authenticated"
    await communicator.send_json_to(_chat("s", world.model, max_tokens=10))
    messages = await _until_done(communicator, {"s"})

    text = "".join(m["content"] for m in messages["s"] if m["type"] == "delta")
    assert text == rest.json()["choices"][0]["message"]["content"]
    # The JSON answer was queued quiet, the socket's stream for a delta per step.
    assert [r.stream for r in await queued_requests(world.model)] == [False, True]
    await communicator.disconnect()


async def test_cancel_stops_one_stream_bills_only_what_was_produced_and_frees_its_blocks(
    world, engine_worker
):
    communicator = await _connect(["pagoda.v1", f"pagoda.bearer.{world.raw_key_a}"])
    assert (await communicator.receive_json_from(timeout=10))["type"] == "authenticated"
    await communicator.send_json_to(_chat("long", world.model, max_tokens=200, ignore_eos=True))
    first = await communicator.receive_json_from(timeout=30)
    assert first["type"] == "delta"

    await communicator.send_json_to({"type": "cancel", "id": "long"})
    messages = await _until_done(communicator, {"long"})

    cancelled = messages["long"][-1]
    assert cancelled["type"] == "cancelled"
    produced = cancelled["usage"]["completion_tokens"]
    assert 1 <= produced < 200
    row = await UsageRecord.objects.aget(request_id=cancelled["request_id"])
    assert (row.status, row.completion_tokens) == ("cancelled", produced)
    stats = await engine_idle(engine_worker)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    await communicator.disconnect()


async def test_malformed_messages_get_an_error_and_the_connection_stays_usable(world, engine_worker):
    communicator = await _connect(["pagoda.v1", f"pagoda.bearer.{world.raw_key_a}"])
    assert (await communicator.receive_json_from(timeout=10))["type"] == "authenticated"

    for raw in ("not json", "[" * 100_000, "[1, 2]"):
        await communicator.send_to(text_data=raw)
        message = await communicator.receive_json_from(timeout=10)
        assert message["type"] == "error" and message["error"]["type"] == "invalid_request_error"
    await communicator.send_json_to(_chat("bad", world.model, max_tokens="many"))
    message = await communicator.receive_json_from(timeout=10)
    assert message["type"] == "error" and message["error"]["param"] == "max_tokens"

    await communicator.send_json_to(_chat("ok", world.model, max_tokens=3))
    messages = await _until_done(communicator, {"ok"})
    assert messages["ok"][-1]["type"] == "done"
    await communicator.disconnect()


async def test_a_stream_that_fails_on_something_unexpected_ends_with_an_error_not_a_hang(world):
    """A malformed engine event (a replica of another protocol version, a bug) raises no
    PlatformError: the stream must still end with an error its client can read, be aborted in the
    engine and billed for what was sent."""
    from engine.protocol import DeltaOutput, Event

    await world.faults.heartbeat()
    communicator = await _connect(["pagoda.v1", f"pagoda.bearer.{world.raw_key_a}"])
    assert (await communicator.receive_json_from(timeout=10))["type"] == "authenticated"
    await communicator.send_json_to(_chat("s", world.model, max_tokens=50))
    request = await world.faults.next_request()
    await world.faults.emit(request.request_id, Event.delta([DeltaOutput(0, "Hi", [5, 6])]))
    assert (await communicator.receive_json_from(timeout=10))["content"] == "Hi"

    await world.faults.emit_raw(request.request_id, {"data": '{"v": 999, "type": "delta"}'})
    message = await communicator.receive_json_from(timeout=10)
    assert message == {
        "type": "error",
        "id": "s",
        "error": {
            "message": "The server had an error while processing your request.",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        },
    }
    assert await world.faults.cancels() == [request.request_id]
    row = await UsageRecord.objects.aget(request_id=request.request_id)
    assert (row.status, row.completion_tokens) == ("error", 2)
    await communicator.disconnect()
