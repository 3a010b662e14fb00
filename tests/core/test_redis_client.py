"""core.redis_client: one asyncio client per event loop, gone with its loop."""

from __future__ import annotations

import asyncio
import gc
import weakref

from core.redis_client import get_async_redis, get_redis, rkey


async def _used_client() -> weakref.ref:
    client = get_async_redis()
    assert get_async_redis() is client  # one client per loop
    assert await client.ping()
    return weakref.ref(client)


def test_each_loop_has_its_own_client_and_a_closed_loops_client_is_let_go() -> None:
    first_loop = asyncio.new_event_loop()
    first_client = first_loop.run_until_complete(_used_client())
    first_loop.close()
    first_loop_ref = weakref.ref(first_loop)
    del first_loop

    # A new loop (which may reuse the closed one's id) gets a client of its own, which works.
    second_client = asyncio.run(_used_client())
    assert second_client() is not first_client()
    gc.collect()
    assert first_client() is None and first_loop_ref() is None, "the closed loop's client was kept"


def test_keys_are_named_under_the_prefix(settings) -> None:
    settings.REDIS_PREFIX = "pagoda-x:"
    assert rkey("queue", "m", 3) == "pagoda-x:queue:m:3"
    assert get_redis().ping()
