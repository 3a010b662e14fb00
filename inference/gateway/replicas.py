"""Engine replicas as seen through their heartbeats: a sorted set of replica ids scored by the
time of their last beat, and one JSON stats key per replica (with a TTL)."""

from __future__ import annotations

import time

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


async def replica_is_live_async(model: str, replica_id: str) -> bool:
    score = await get_async_redis().zscore(replicas_key(settings.REDIS_PREFIX, model), replica_id)
    return score is not None and score >= _cutoff()


def replica_stats_list(model: str) -> list[ReplicaStats]:
    """Stats of the replicas with a fresh heartbeat, ordered by replica id. A replica whose stats
    key has expired or is malformed is left out: it is not serving."""
    ids = sorted(live_replica_ids(model))
    if not ids:
        return []
    raw = get_redis().mget([replica_stats_key(settings.REDIS_PREFIX, model, rid) for rid in ids])
    stats: list[ReplicaStats] = []
    for data in raw:
        if data is None:
            continue
        try:
            stats.append(ReplicaStats.decode(data))
        except ProtocolError:
            continue
    return stats
