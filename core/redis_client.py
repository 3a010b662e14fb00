"""One Redis connection pool per process (sync and asyncio), and key naming under REDIS_PREFIX."""

from __future__ import annotations

import functools

import redis
import redis.asyncio as aioredis
from django.conf import settings

# Every streamed request holds an asyncio connection while it waits on its output stream, and
# request threads each take a sync one: redis-py's default cap of 100 refused the 101st concurrent
# stream with MaxConnectionsError. Blocking pools wait for a free connection instead of failing, and
# the cap stays below redis-server's default maxclients (10000).
MAX_CONNECTIONS = 4096
POOL_TIMEOUT_S = 30
# Redis unreachable (down, restarting, a network blip), as both clients raise it.
REDIS_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)


@functools.cache
def get_redis() -> redis.Redis:
    pool = redis.BlockingConnectionPool.from_url(
        settings.REDIS_URL,
        decode_responses=False,
        health_check_interval=30,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_TIMEOUT_S,
    )
    return redis.Redis(connection_pool=pool)


_async_clients: dict[int, aioredis.Redis] = {}


def get_async_redis() -> aioredis.Redis:
    """One asyncio client per event loop (a client must not cross loops)."""
    import asyncio

    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL,
            decode_responses=False,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_TIMEOUT_S,
        )
        client = aioredis.Redis(connection_pool=pool)
        _async_clients[loop_id] = client
    return client


def rkey(*parts: object) -> str:
    return settings.REDIS_PREFIX + ":".join(str(p) for p in parts)
