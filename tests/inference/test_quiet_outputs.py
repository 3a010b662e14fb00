"""Requests whose answer is one body are queued quiet: the replica publishes their first tokens at
once and the rest in few deltas; streamed ones get a delta per step. The answers are the same."""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.test import AsyncClient

from core.redis_client import get_async_redis
from engine.protocol import Event, output_stream
from tests.helpers import api_post, sse_events
from tests.inference.conftest import queued_requests

pytestmark = pytest.mark.django_db(transaction=True)

MAX_TOKENS = 40
BODY = {
    "messages": [{"role": "user", "content": "Tell me a story"}],
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}


async def deltas_of(request_id: str) -> list[Event]:
    entries = await get_async_redis().xrange(output_stream(settings.REDIS_PREFIX, request_id))
    return [event for _, fields in entries if (event := Event.decode(fields)).type == "delta"]


async def test_a_json_answer_is_queued_quiet_and_equals_the_streamed_one(world, engine_worker):
    whole = await api_post(world, "/v1/chat/completions", {"model": world.model, **BODY})
    streamed = await AsyncClient().post(
        "/v1/chat/completions",
        json.dumps({"model": world.model, **BODY, "stream": True}),
        content_type="application/json",
        headers=world.headers(),
    )
    raw = b"".join([chunk async for chunk in streamed.streaming_content])

    assert whole.status_code == streamed.status_code == 200
    quiet, loud = await queued_requests(world.model)
    assert (quiet.stream, loud.stream) == (False, True)
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert whole.json()["choices"][0]["message"]["content"] == text
    assert whole.json()["usage"]["completion_tokens"] == MAX_TOKENS
    # A delta per step for the stream; its first token, then few for the JSON answer.
    assert len(await deltas_of(loud.request_id)) == MAX_TOKENS
    quiet_deltas = await deltas_of(quiet.request_id)
    assert 2 <= len(quiet_deltas) < MAX_TOKENS / 2
    assert len(quiet_deltas[0].outputs[0]["token_ids"]) == 1
