"""One Redis connection pool per process (sync and asyncio), and key naming under REDIS_PREFIX."""

from __future__ import annotations

import asyncio
import functools
import weakref

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


# Each event loop's client, as the stream readers and live sets are kept. A client's open connections
# refer to their loop, so a weak key alone would never let an entry go: the entries of closed loops
# are dropped whenever a client is asked for, and the loop, its client and its sockets are then
# garbage.
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
    weakref.WeakKeyDictionary()
)


def get_async_redis() -> aioredis.Redis:
    """The running event loop's asyncio client (a client must not cross loops)."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        for closed in [other for other in _async_clients.keys() if other.is_closed()]:
            del _async_clients[closed]
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL,
            decode_responses=False,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_TIMEOUT_S,
        )
        client = _async_clients[loop] = aioredis.Redis(connection_pool=pool)
    return client


def rkey(*parts: object) -> str:
    return settings.REDIS_PREFIX + ":".join(str(p) for p in parts)
