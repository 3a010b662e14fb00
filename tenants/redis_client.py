"""One Redis connection pool per process (sync and asyncio), and key naming under REDIS_PREFIX."""

from __future__ import annotations

import functools

import redis
import redis.asyncio as aioredis
from django.conf import settings


@functools.cache
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=False, health_check_interval=30)


_async_clients: dict[int, aioredis.Redis] = {}


def get_async_redis() -> aioredis.Redis:
    """One asyncio client per event loop (a client must not cross loops)."""
    import asyncio

    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        client = aioredis.Redis.from_url(settings.REDIS_URL, decode_responses=False)
        _async_clients[loop_id] = client
    return client


def rkey(*parts: object) -> str:
    return settings.REDIS_PREFIX + ":".join(str(p) for p in parts)
