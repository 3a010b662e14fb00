"""Engine replicas as seen through their heartbeats: a sorted set of replica ids scored by the
time of their last beat, and one JSON stats key per replica (with a TTL).

Live: its heartbeat is fresh; a request it holds is in good hands. Ready: live and not draining (a
replica shutting down finishes what it runs but takes nothing new); new requests need one."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from django.conf import settings

from core.redis_client import get_async_redis, get_redis
from engine.protocol import ProtocolError, ReplicaStats, replica_stats_key, replicas_key

T = TypeVar("T")


def _cutoff() -> float:
    return time.time() - settings.ENGINE_HEARTBEAT_TTL


def _ids(raw: list) -> list[str]:
    return [r.decode() if isinstance(r, bytes) else str(r) for r in raw]


def live_replica_ids(model: str) -> list[str]:
    key = replicas_key(settings.REDIS_PREFIX, model)
    return _ids(get_redis().zrangebyscore(key, _cutoff(), "+inf"))


async def live_replica_ids_async(model: str) -> list[str]:
    key = replicas_key(settings.REDIS_PREFIX, model)
    return _ids(await get_async_redis().zrangebyscore(key, _cutoff(), "+inf"))


# How long the live set of a model read by one event loop serves its other requests. Requests
# waiting out a long engine step all check their replica at the end of each wait: without it, every
# one of them is a Redis round trip of its own, twice a second. Far below ENGINE_HEARTBEAT_TTL.
LIVE_SET_MAX_AGE_S = 0.25


class LoopShared(Generic[T]):
    """Values read from Redis that one event loop's requests share for up to `max_age_s`, by key:
    one read in flight at a time, the others wait for it. A finished read leaves only its value,
    so the entries go with their loop."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._entries: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, tuple[float, T | asyncio.Future]]
        ] = weakref.WeakKeyDictionary()

    async def get(self, key: str, read: Callable[[], Awaitable[T]]) -> T:
        loop = asyncio.get_running_loop()
        entries = self._entries.setdefault(loop, {})
        now = time.monotonic()
        cached = entries.get(key)
        if cached is not None and cached[0] >= now:
            value = cached[1]
            return await asyncio.shield(value) if isinstance(value, asyncio.Future) else value
        expiry, reading = now + self.max_age_s, loop.create_future()
        entries[key] = (expiry, reading)
        try:
            result = await read()
        except BaseException as exc:
            entries.pop(key, None)
            reading.set_exception(exc)
            reading.exception()  # retrieved: the requests sharing it see it through shield()
            raise
        if entries.get(key) == (expiry, reading):  # not replaced by a later read meanwhile
            entries[key] = (expiry, result)
        reading.set_result(result)
        return result

    def put(self, key: str, value: T) -> None:
        """A value this loop read for `key` by other means: shared as a read of its own would be."""
        loop = asyncio.get_running_loop()
        self._entries.setdefault(loop, {})[key] = (time.monotonic() + self.max_age_s, value)

    def clear(self) -> None:
        self._entries.clear()


_live_sets: LoopShared[frozenset[str]] = LoopShared(LIVE_SET_MAX_AGE_S)


async def live_replica_set_async(model: str) -> frozenset[str]:
    """The ids of `model`'s live replicas, shared by the running event loop's requests for up to
    LIVE_SET_MAX_AGE_S (one read in flight at a time)."""

    async def read() -> frozenset[str]:
        return frozenset(await live_replica_ids_async(model))

    return await _live_sets.get(model, read)


def without_draining(ids: list[str], raw: list) -> list[str]:
    """The ids whose stats (`raw`, in the same order) do not say draining."""
    # Only the flag is read: a replica whose stats this process cannot decode (a newer engine's
    # fields, a key that expired a moment before its score) counts as ready, as it counts as live.
    ready = []
    for replica_id, data in zip(ids, raw, strict=True):
        try:
            draining = data is not None and json.loads(data).get("draining") is True
        except (TypeError, ValueError, AttributeError):
            draining = False
        if not draining:
            ready.append(replica_id)
    return ready


def _stats_keys(model: str, ids: list[str]) -> list[str]:
    return [replica_stats_key(settings.REDIS_PREFIX, model, rid) for rid in ids]


def ready_replica_ids(model: str) -> list[str]:
    """Live replicas of `model` that take new requests (not draining)."""
    ids = live_replica_ids(model)
    if not ids:
        return []
    return without_draining(ids, get_redis().mget(_stats_keys(model, ids)))


async def heartbeats_async(model: str) -> tuple[list[str], list]:
    """The ids of `model`'s live replicas and their raw stats, in the same order."""
    ids = await live_replica_ids_async(model)
    return ids, (await get_async_redis().mget(_stats_keys(model, ids)) if ids else [])


async def ready_replica_ids_async(model: str) -> list[str]:
    """Live replicas of `model` that take new requests (not draining)."""
    return without_draining(*await heartbeats_async(model))


def replica_stats_list(model: str) -> list[ReplicaStats]:
    """Stats of the replicas with a fresh heartbeat, ordered by replica id. A replica whose stats
    key has expired or is malformed is left out: it is not serving."""
    ids = sorted(live_replica_ids(model))
    if not ids:
        return []
    raw = get_redis().mget(_stats_keys(model, ids))
    stats: list[ReplicaStats] = []
    for data in raw:
        if data is None:
            continue
        try:
            stats.append(ReplicaStats.decode(data))
        except ProtocolError:
            continue
    return stats
