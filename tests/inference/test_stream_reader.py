"""The web process's shared reader of engine output streams, against the real Redis: one XREAD per
event loop serves every waiting request; new streams wake it; errors reach the waiting requests."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from core.redis_client import get_redis
from engine.protocol import output_stream
from inference.gateway.reader import BLOCK_MS, StreamReader, get_stream_reader
from tests.helpers import async_wait_until

# Well below the reader's own BLOCK_MS: a read that waited for the block to run out fails.
PROMPT_S = min(5.0, BLOCK_MS / 2000)


@pytest.fixture
def prefix():
    prefix = f"test-reader-{uuid.uuid4().hex[:8]}:"
    yield prefix
    redis = get_redis()
    keys = list(redis.scan_iter(match=f"{prefix}*"))
    if keys:
        redis.delete(*keys)


def _xadd(prefix: str, request_id: str, value: str) -> bytes:
    return get_redis().xadd(output_stream(prefix, request_id), {b"v": value.encode()})


async def test_one_read_serves_every_waiting_stream_in_order(prefix):
    reader = StreamReader(prefix)
    request_ids = [f"r{i}" for i in range(16)]
    positions = {rid: {rid: "0-0"} for rid in request_ids}
    received: dict[str, list[bytes]] = {rid: [] for rid in request_ids}

    async def consume(rid: str, steps: int) -> None:
        while len(received[rid]) < steps:
            for got_rid, (_, fields) in await reader.read(positions[rid], block_ms=30_000):
                assert got_rid == rid
                received[rid].append(fields[b"v"])

    steps = 20
    consumers = [asyncio.ensure_future(consume(rid, steps)) for rid in request_ids]
    # The shared read covers every stream (the reads before it were woken by new registrations).
    await async_wait_until(lambda: reader.num_streams_read == len(request_ids))
    reads_before = reader.num_reads
    for step in range(steps):
        # One engine step: an entry for every stream, pipelined as the engine publishes them.
        pipe = get_redis().pipeline(transaction=False)
        for rid in request_ids:
            pipe.xadd(output_stream(prefix, rid), {b"v": f"{rid}-{step}".encode()})
        pipe.execute()
        await async_wait_until(lambda step=step: all(len(received[r]) > step for r in request_ids))
    await asyncio.wait_for(asyncio.gather(*consumers), 30)
    reads = reader.num_reads - reads_before

    for rid in request_ids:
        assert received[rid] == [f"{rid}-{s}".encode() for s in range(steps)]
        last_id = get_redis().xrevrange(output_stream(prefix, rid), count=1)[0][0].decode()
        assert positions[rid][rid] == last_id
    # A read per request per step would be 16 x 20 = 320.
    assert reads <= 3 * steps, reads
    await reader.forget(request_ids)
    await async_wait_until(lambda: reader._task is None)


async def test_entries_written_before_the_first_read_are_returned(prefix):
    reader = StreamReader(prefix)
    first = _xadd(prefix, "a", "one")
    _xadd(prefix, "a", "two")
    positions = {"a": "0-0"}
    got = await reader.read(positions, block_ms=5_000)
    assert [fields[b"v"] for _, (_, fields) in got] == [b"one", b"two"]
    # From a later position only what follows it.
    later = StreamReader(prefix)
    got = await later.read({"a": first.decode()}, block_ms=5_000)
    assert [fields[b"v"] for _, (_, fields) in got] == [b"two"]
    await reader.forget(["a"])
    await later.forget(["a"])


async def test_a_new_stream_wakes_the_blocked_read(prefix):
    reader = StreamReader(prefix)
    # The shared read blocks on stream a (for BLOCK_MS) before b is registered.
    assert await reader.read({"a": "0-0"}, block_ms=50) == []
    await async_wait_until(lambda: reader._reading and reader.num_streams_read == 1)

    async def read_b() -> list:
        return await reader.read({"b": "0-0"}, block_ms=30_000)

    started = time.monotonic()
    task = asyncio.ensure_future(read_b())
    await async_wait_until(lambda: reader.num_streams == 2)
    _xadd(prefix, "b", "hello")
    [(rid, (_, fields))] = await asyncio.wait_for(task, 30)
    assert (rid, fields[b"v"]) == ("b", b"hello")
    assert time.monotonic() - started < PROMPT_S
    await reader.forget(["a", "b"])
    await async_wait_until(lambda: reader._task is None)


async def test_nothing_within_the_block_is_an_empty_read(prefix):
    reader = StreamReader(prefix)
    positions = {"quiet": "0-0"}
    assert await reader.read(positions, block_ms=100) == []
    assert positions == {"quiet": "0-0"}
    await reader.forget(["quiet"])
    await async_wait_until(lambda: reader._task is None)


async def test_a_read_error_reaches_the_waiting_requests_and_reading_resumes(prefix):
    reader = StreamReader(prefix)
    _xadd(prefix, "good", "before")
    positions = {"good": "0-0"}
    [(_, (_, fields))] = await reader.read(positions, block_ms=5_000)
    assert fields[b"v"] == b"before"

    # A key of the wrong type makes the shared XREAD fail for every stream in it.
    get_redis().set(output_stream(prefix, "bad"), "not a stream")
    with pytest.raises(Exception, match="WRONGTYPE"):
        await reader.read({"bad": "0-0", **positions}, block_ms=30_000)

    get_redis().delete(output_stream(prefix, "bad"))
    _xadd(prefix, "good", "after")
    got = await reader.read(positions, block_ms=30_000)
    assert [fields[b"v"] for _, (_, fields) in got] == [b"after"]  # nothing skipped or repeated
    await reader.forget(["good", "bad"])
    await async_wait_until(lambda: reader._task is None)


async def test_a_read_that_fails_before_its_caller_waits_still_raises(prefix, monkeypatch):
    """The shared read can fail while the request that registered the bad stream is still waking
    the reader (a busy loop, a slow Redis answer): the error must still reach that request."""
    reader = StreamReader(prefix)
    _xadd(prefix, "good", "before")
    positions = {"good": "0-0"}
    await reader.read(positions, block_ms=5_000)
    wake = reader._wake

    async def wake_then_wait_for_the_failure() -> None:
        await wake()
        await async_wait_until(lambda: not reader._reading, what="the shared read to fail")

    monkeypatch.setattr(reader, "_wake", wake_then_wait_for_the_failure)
    get_redis().set(output_stream(prefix, "bad"), "not a stream")
    started = time.monotonic()
    with pytest.raises(Exception, match="WRONGTYPE"):
        await reader.read({"bad": "0-0", **positions}, block_ms=20_000)
    assert time.monotonic() - started < 15  # raised, not timed out


async def test_each_event_loop_has_its_own_reader(prefix):
    reader = get_stream_reader(prefix)
    assert get_stream_reader(prefix) is reader

    other: list[StreamReader] = []

    def in_another_loop() -> None:
        async def take() -> None:
            other.append(get_stream_reader(prefix))

        asyncio.run(take())

    await asyncio.to_thread(in_another_loop)
    assert other[0] is not reader
