"""Prompts do not stay in Redis: an answered request's entry leaves the request stream once its
replay window (the output streams' lifetime) is over, and an entry still waiting or running never
does; output streams expire."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from django.conf import settings

from engine.protocol import CONSUMER_GROUP, Event, GenerateRequest, output_stream
from engine.worker import RequestQueue
from tests.helpers import wait_until


@pytest.fixture
def queue():
    client = redis.Redis.from_url(settings.REDIS_URL)
    prefix = f"{settings.REDIS_PREFIX}retention-{uuid.uuid4().hex[:8]}:"
    q = RequestQueue(client, prefix=prefix, model="m", replica_id="r1", output_ttl_s=60, heartbeat_ttl_s=5)
    q.ensure_group()
    yield q
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


def _queue_request(q: RequestQueue, request_id: str) -> None:
    request = GenerateRequest(
        request_id=request_id, model="m", prompt_token_ids=[1, 2, 3], sampling_params={"max_tokens": 1}
    )
    q.client.xadd(q.stream, request.encode())


def _clock_past_entries(q: RequestQueue) -> None:
    """Until the clock has left the millisecond of the newest entry: "older than 0 s" holds for
    every entry only then (stream ids are millisecond timestamps)."""
    [(newest, _)] = q.client.xrevrange(q.stream, count=1)
    ms = int(newest.split(b"-")[0])
    wait_until(lambda: time.time() * 1000 >= ms + 1, timeout=5, interval=0.001, what="the next millisecond")


def _ids_left(q: RequestQueue) -> list[str]:
    return [GenerateRequest.decode(fields).request_id for _, fields in q.client.xrange(q.stream)]


def test_only_answered_requests_past_the_window_leave_the_stream(queue):
    for rid in ("answered", "running", "waiting"):
        _queue_request(queue, rid)
    taken = queue.read_new(2, None)  # answered and running: delivered to this replica
    queue.client.xack(queue.stream, CONSUMER_GROUP, taken[0][0].id)

    queue.trim_answered(retention_s=3600)
    assert _ids_left(queue) == ["answered", "running", "waiting"]  # within the window

    _clock_past_entries(queue)
    queue.trim_answered(retention_s=0)
    assert _ids_left(queue) == ["running", "waiting"]

    queue.client.xack(queue.stream, CONSUMER_GROUP, taken[1][0].id)
    queue.trim_answered(retention_s=0)
    assert _ids_left(queue) == ["waiting"]  # never delivered: it stays whatever its age

    [(message_id, _fields)] = queue.read_new(1, None)
    queue.client.xack(queue.stream, CONSUMER_GROUP, message_id.id)
    queue.trim_answered(retention_s=0)
    assert _ids_left(queue) == []


def test_output_streams_expire(queue):
    queue.publish([("r-1", Event(type="finished"))], [])
    ttl = queue.client.ttl(output_stream(queue.prefix, "r-1"))
    assert 0 < ttl <= 60
