"""A replica's own request stream beside its model's shared one (engine.worker.queue), against a real
Redis and without an engine: the order of reads, stealing after the delay, retiring a stream as its
replica leaves or is lost, and reclaim and hand-back across streams."""

from __future__ import annotations

import time

import pytest
import redis

from engine.protocol import (
    CONSUMER_GROUP,
    GenerateRequest,
    replica_requests_stream,
    replicas_key,
    requests_stream,
    routes_key,
)
from engine.worker.queue import ORPHAN_MIN_IDLE_MS, EntryRef, model_request_streams
from tests.engine.test_worker import MODEL, PROMPT, REDIS_URL, drop_keys, new_prefix, queue_of, submit
from tests.helpers import wait_until


@pytest.fixture
def client():
    c = redis.Redis.from_url(REDIS_URL)
    try:
        c.ping()
    except redis.ConnectionError:
        pytest.skip("Redis is not reachable")
    yield c
    c.close()


@pytest.fixture
def prefix(client):
    p = new_prefix()
    yield p
    drop_keys(client, p)


def route(client: redis.Redis, prefix: str, replica_id: str, request_id: str, *, age_s: float = 0) -> bytes:
    """Queue a request to a replica's own stream, as the web tier's routing does; `age_s`: as if
    queued that long ago (entry ids are timestamps)."""
    request = GenerateRequest(
        request_id=request_id, model=MODEL, prompt_token_ids=PROMPT, sampling_params={}, tenant="t"
    )
    entry_id = f"{int((time.time() - age_s) * 1000)}-*" if age_s else "*"
    return client.xadd(replica_requests_stream(prefix, MODEL, replica_id), request.encode(), id=entry_id)


def ids(entries) -> list[str]:
    return [GenerateRequest.decode(fields).request_id for _, fields, *_ in entries]


def test_a_replica_reads_its_own_stream_first_then_the_shared_one_within_its_room(client, prefix):
    queue = queue_of(client, prefix, "left")
    queue.ensure_group()
    submit(client, prefix, "shared-1")
    submit(client, prefix, "shared-2")
    route(client, prefix, "left", "own-1")

    first = queue.read_new(2, None)

    assert ids(first) == ["own-1", "shared-1"]
    assert [ref.stream for ref, _ in first] == [queue.own_stream, queue.stream]
    assert ids(queue.read_new(5, None)) == ["shared-2"]
    assert queue.num_routed == 1
    assert client.smembers(routes_key(prefix, MODEL)) == {b"left"}


def test_an_idle_replica_steals_only_what_waited_past_the_delay_oldest_first(client, prefix):
    busy, idle = queue_of(client, prefix, "busy"), queue_of(client, prefix, "idle")
    busy.ensure_group()
    idle.ensure_group()
    route(client, prefix, "busy", "old-1", age_s=30)
    route(client, prefix, "busy", "old-2", age_s=30)
    route(client, prefix, "busy", "new")

    assert idle.steal(10, 60_000) == []  # nothing waited a minute
    stolen = idle.steal(1, 10_000)
    assert ids(stolen) == ["old-1"]
    stolen += idle.steal(10, 10_000)
    assert ids(stolen) == ["old-1", "old-2"]  # the one routed just now is not taken
    assert idle.num_stolen == 2
    # The stolen entries are held by the thief in the busy replica's stream; the busy replica reads
    # only what was left.
    rows = client.xpending_range(busy.own_stream, CONSUMER_GROUP, "-", "+", 10)
    assert {row["consumer"] for row in rows} == {b"idle"}
    assert ids(busy.read_new(10, None)) == ["new"]
    # And it acks them where they are.
    idle.publish([], [ref for ref, _ in stolen])
    rows = client.xpending_range(busy.own_stream, CONSUMER_GROUP, "-", "+", 10)
    assert [row["consumer"] for row in rows] == [b"busy"]


def test_a_leaving_replica_moves_what_nobody_read_to_the_shared_stream_and_deletes_its_own(client, prefix):
    leaving, staying = queue_of(client, prefix, "leaving"), queue_of(client, prefix, "staying")
    leaving.ensure_group()
    staying.ensure_group()
    route(client, prefix, "leaving", "taken")
    [(taken, _)] = leaving.read_new(1, None)
    route(client, prefix, "leaving", "unread")

    assert leaving.retire("leaving") == 1
    # Still holding one: the stream stays (so the held entry can be acked) and is still routed to.
    assert client.exists(leaving.own_stream) == 1
    assert ids(staying.read_new(10, None)) == ["unread"]

    leaving.publish([], [taken])
    leaving.leave_group()
    assert client.exists(leaving.own_stream) == 0
    assert client.smembers(routes_key(prefix, MODEL)) == {b"staying"}
    assert model_request_streams(client, prefix, MODEL) == [
        requests_stream(prefix, MODEL),
        replica_requests_stream(prefix, MODEL, "staying"),
    ]


def test_a_lost_replicas_stream_is_claimed_and_moved_at_once_then_deleted(client, prefix):
    lost, claimer = queue_of(client, prefix, "lost"), queue_of(client, prefix, "claimer")
    lost.ensure_group()
    claimer.ensure_group()
    route(client, prefix, "lost", "held-by-lost")
    lost.read_new(1, None)
    route(client, prefix, "lost", "never-read")
    now = time.time()
    client.zadd(replicas_key(prefix, MODEL), {"claimer": now, "lost": now - 60})

    def entry_idle() -> bool:
        rows = client.xpending_range(lost.own_stream, CONSUMER_GROUP, "-", "+", 1)
        return rows[0]["time_since_delivered"] > ORPHAN_MIN_IDLE_MS

    wait_until(entry_idle, timeout=10, what="the lost replica's entry to idle")
    claimed = claimer.claim_orphans(10)

    # What the lost replica held is claimed where it is; what it never read went to the shared
    # stream, for any replica's next read.
    assert ids(claimed) == ["held-by-lost"]
    assert claimed[0][0].stream == lost.own_stream
    assert ids(claimer.read_new(10, None)) == ["never-read"]
    assert client.exists(lost.own_stream) == 1  # one entry is still pending there (the claimer's)

    claimer.publish([], [claimed[0][0]])
    claimer.claim_orphans(10)
    assert client.exists(lost.own_stream) == 0
    assert client.smembers(routes_key(prefix, MODEL)) == {b"claimer"}


def test_touch_hand_back_and_release_work_on_the_stream_each_entry_is_in(client, prefix):
    queue = queue_of(client, prefix, "left")
    queue.ensure_group()
    route(client, prefix, "left", "routed")
    submit(client, prefix, "shared")
    entries = queue.read_new(10, None)
    refs = [ref for ref, _ in entries]
    assert {ref.stream for ref in refs} == {queue.own_stream, queue.stream}

    assert queue.touch(refs) == set(refs)
    assert queue.touch([EntryRef(queue.own_stream, b"1-0")]) == set()  # not ours

    handed = queue.hand_back(refs)

    assert handed == set(refs)
    # Both went back to the shared stream as new entries marked handed; the originals are acked
    # (each stream's last delivered one stays until trimmed, so that Redis can tell the group's lag).
    again = queue_of(client, prefix, "right").read_new(10, None)
    assert sorted(ids(again)) == ["routed", "shared"]
    assert all(fields[b"handed"] == b"1" and ref.stream == queue.stream for ref, fields in again)
    assert client.xpending(queue.own_stream, CONSUMER_GROUP)["pending"] == 0
    assert [group["lag"] for group in client.xinfo_groups(queue.own_stream)] == [0]


def test_a_replica_whose_stream_was_retired_while_it_stalled_opens_it_again(client, prefix):
    stalled, other = queue_of(client, prefix, "stalled"), queue_of(client, prefix, "other")
    stalled.ensure_group()
    other.retire("stalled")  # taken for lost
    assert client.exists(stalled.own_stream) == 0

    assert stalled.read_new(10, None) == []
    assert client.exists(stalled.own_stream) == 1
    assert b"stalled" in client.smembers(routes_key(prefix, MODEL))


def test_every_read_before_a_step_opens_a_retired_stream_again(client, prefix):
    """The turn's read (with its cancels) and a publish's read ahead take a retired stream's missing
    group the same way: made again, and nothing read from it counted twice."""
    stalled, other = queue_of(client, prefix, "stalled"), queue_of(client, prefix, "other")
    stalled.ensure_group()

    other.retire("stalled")
    turn = stalled.read_turn(10, None)
    assert (turn.entries, turn.cancels) == ([], [])
    assert client.exists(stalled.own_stream) == 1

    other.retire("stalled")
    ahead = stalled.publish([], [], read_ahead=10)
    assert ahead is not None and ahead.entries is None  # the next turn reads again
    assert client.exists(stalled.own_stream) == 1
    submit(client, prefix, "after", PROMPT)
    again = stalled.publish([], [], read_ahead=10)
    assert again is not None and again.entries is not None
    assert ids(again.entries) == ["after"]
    assert stalled.num_routed == 0  # from the shared stream
