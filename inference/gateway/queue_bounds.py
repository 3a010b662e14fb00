"""Bounded queues: how many requests may wait to start on a model, all tenants together and per tenant.

A request holds a place from just before it is queued until its first event arrives (it started,
or it ended without starting) or it ends. Beyond a bound it is refused with a 429 whose
Retry-After comes from the rate at which the model's queue drained over the last minute. The
places live in Redis (sorted sets scored by when they were taken), so every web process sees the
same counts; places older than STALE_S are dropped, so a web process that died leaks none for long.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from django.conf import settings

from core.redis_client import get_async_redis

logger = logging.getLogger(__name__)
_RELEASES: set[asyncio.Future] = set()

# A place held this long belongs to a request whose web process died: no wait is that long.
STALE_S = 3600
DRAIN_WINDOW_S = 60
MAX_RETRY_AFTER_S = 60

# KEYS: model queue, tenant queue, model starts. ARGV: now, model max, tenant max (-1: none), stale
# horizon, drain window start, TTL, then the request ids. All of a request's places are taken in
# one call or none is: a caller cancelled mid-way cannot leave some of them held. Returns {0} when
# they were taken, else {1 (model) or 2 (tenant), places held, starts within the window}.
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
local wanted = #ARGV - 6
local starts = redis.call('ZCOUNT', KEYS[3], ARGV[5], '+inf')
local held = redis.call('ZCARD', KEYS[1])
if tonumber(ARGV[2]) >= 0 and held + wanted > tonumber(ARGV[2]) then return {1, held, starts} end
local mine = redis.call('ZCARD', KEYS[2])
if tonumber(ARGV[3]) >= 0 and mine + wanted > tonumber(ARGV[3]) then return {2, mine, starts} end
for i = 7, #ARGV do
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return {0}
"""


def _keys(model: str, tenant: str) -> tuple[str, str, str]:
    prefix = settings.REDIS_PREFIX
    return (f"{prefix}queued:{model}", f"{prefix}queued:{model}:tenant:{tenant}", f"{prefix}starts:{model}")


@dataclass(frozen=True, slots=True)
class QueueFull:
    scope: str  # model | tenant
    held: int
    retry_after_s: int


def retry_after(*, starts_in_window: int, ahead: int) -> int:
    """Seconds until `ahead` requests have started at the rate the queue drained lately."""
    rate = starts_in_window / DRAIN_WINDOW_S
    if rate <= 0:
        return MAX_RETRY_AFTER_S
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(ahead / rate)))


async def queue_place_take(
    *, model: str, tenant: str, request_ids: list[str], model_max: int | None, tenant_max: int | None
) -> QueueFull | None:
    """Take a place for each of a request's engine requests (all or none), or say which bound is full.

    Cancelled while the script runs (the places may be taken, the reply never read), it gives them
    back before the cancellation goes on: only a caller that got None holds places."""
    if not request_ids:
        return None
    now = time.time()
    reply = None
    try:
        reply = await get_async_redis().eval(
            _TAKE,
            3,
            *_keys(model, tenant),
            now,
            -1 if model_max is None else model_max,
            -1 if tenant_max is None else tenant_max,
            now - STALE_S,
            now - DRAIN_WINDOW_S,
            STALE_S,
            *request_ids,
        )
    finally:
        if reply is None:
            # A task of its own, shielded and referenced: a second cancellation cannot cut it short.
            release = asyncio.ensure_future(
                _release_quietly(model=model, tenant=tenant, request_ids=request_ids)
            )
            _RELEASES.add(release)
            release.add_done_callback(_RELEASES.discard)
            await asyncio.shield(release)
    if int(reply[0]) == 0:
        return None
    scope, held, starts = ("model" if int(reply[0]) == 1 else "tenant"), int(reply[1]), int(reply[2])
    bound = (model_max if scope == "model" else tenant_max) or 0
    ahead = held + len(request_ids) - bound
    return QueueFull(scope, held, retry_after(starts_in_window=starts, ahead=ahead))


async def _release_quietly(*, model: str, tenant: str, request_ids: list[str]) -> None:
    try:
        await queue_place_release(model=model, tenant=tenant, request_ids=request_ids)
    except Exception:  # Redis unreachable: the places expire with STALE_S
        logger.exception("could not give back the queue places of %s", request_ids[0])


async def queue_place_release(
    *, model: str, tenant: str, request_ids: list[str], started: bool = False
) -> None:
    """Give the places back (idempotent); `started` records them in the model's drain rate."""
    if not request_ids:
        return
    queue, tenant_queue, starts = _keys(model, tenant)
    now = time.time()
    async with get_async_redis().pipeline(transaction=False) as pipe:
        pipe.zrem(queue, *request_ids)
        pipe.zrem(tenant_queue, *request_ids)
        if started:
            pipe.zadd(starts, dict.fromkeys(request_ids, now))
            pipe.zremrangebyscore(starts, "-inf", now - DRAIN_WINDOW_S)
            pipe.expire(starts, DRAIN_WINDOW_S * 2)
        await pipe.execute()
