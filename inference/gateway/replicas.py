"""Engine replicas as seen through their heartbeats: a sorted set of replica ids scored by the
time of their last beat, and one JSON stats key per replica (with a TTL).

Live: its heartbeat is fresh; a request it holds is in good hands. Ready: live and not draining (a
replica shutting down finishes what it runs but takes nothing new); new requests need one."""

from __future__ import annotations

import asyncio
import json
import time
import weakref

from django.conf import settings

from core.redis_client import get_async_redis, get_redis
from engine.protocol import ProtocolError, ReplicaStats, replica_stats_key, replicas_key


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

# Each event loop's live sets, by model: (expiry, the set, or the read of it while in flight). A
# finished read leaves only its set, so the entries go with their loop.
_live_sets: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[str, tuple[float, frozenset[str] | asyncio.Future]]
] = weakref.WeakKeyDictionary()


async def live_replica_set_async(model: str) -> frozenset[str]:
    """The ids of `model`'s live replicas, shared by the running event loop's requests for up to
    LIVE_SET_MAX_AGE_S (one read in flight at a time)."""
    loop = asyncio.get_running_loop()
    live_sets = _live_sets.setdefault(loop, {})
    now = time.monotonic()
    cached = live_sets.get(model)
    if cached is not None and cached[0] >= now:
        ids_or_read = cached[1]
        return ids_or_read if isinstance(ids_or_read, frozenset) else await asyncio.shield(ids_or_read)
    expiry, read = now + LIVE_SET_MAX_AGE_S, loop.create_future()
    live_sets[model] = (expiry, read)
    try:
        ids = frozenset(await live_replica_ids_async(model))
    except BaseException as exc:
        live_sets.pop(model, None)
        read.set_exception(exc)
        read.exception()  # retrieved: the requests sharing it see it through shield()
        raise
    if live_sets.get(model) == (expiry, read):  # not replaced by a later read meanwhile
        live_sets[model] = (expiry, ids)
    read.set_result(ids)
    return ids


def _without_draining(ids: list[str], raw: list) -> list[str]:
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
    return _without_draining(ids, get_redis().mget(_stats_keys(model, ids)))


async def ready_replica_ids_async(model: str) -> list[str]:
    """Live replicas of `model` that take new requests (not draining): what admission asks for."""
    ids = await live_replica_ids_async(model)
    if not ids:
        return []
    return _without_draining(ids, await get_async_redis().mget(_stats_keys(model, ids)))


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
