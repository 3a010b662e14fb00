"""A replica that injects protocol faults: it speaks engine/protocol.py over the real Redis, but
only to produce what the real engine worker cannot be made to produce on demand (an error event in
the middle of a stream, a malformed event, a replica that vanishes while holding a request).

Healthy serving is tested against the real engine worker (the `engine_worker` fixture).
"""

from __future__ import annotations

import time

from django.conf import settings

from core.redis_client import get_async_redis
from engine.protocol import (
    Event,
    GenerateRequest,
    ReplicaStats,
    cancel_request_id,
    cancel_stream,
    output_stream,
    replica_stats_key,
    replicas_key,
    requests_stream,
)


class ProtocolFaultInjector:
    def __init__(self, model: str, replica_id: str = "fault-injector-1") -> None:
        self.model = model
        self.replica_id = replica_id
        self.prefix = settings.REDIS_PREFIX
        self._cursor = "0-0"

    async def heartbeat(self, *, num_free_blocks: int = 10, **stats) -> None:
        """Announce a live replica with the given stats (the real one's are whatever it measures)."""
        redis = get_async_redis()
        body = ReplicaStats(
            replica_id=self.replica_id,
            model=self.model,
            num_running=stats.get("num_running", 0),
            num_waiting=stats.get("num_waiting", 0),
            kv_cache_usage=stats.get("kv_cache_usage", 0.0),
            prefix_cache_hit_rate=stats.get("prefix_cache_hit_rate", 0.0),
            num_free_blocks=num_free_blocks,
            num_total_blocks=10,
            heartbeat_at=time.time(),
            draining=stats.get("draining", False),
        )
        await redis.set(replica_stats_key(self.prefix, self.model, self.replica_id), body.encode(), ex=30)
        await redis.zadd(replicas_key(self.prefix, self.model), {self.replica_id: time.time()})

    async def vanish(self) -> None:
        """Disappear as a killed replica does: no more heartbeats, nothing more on any stream."""
        redis = get_async_redis()
        await redis.zrem(replicas_key(self.prefix, self.model), self.replica_id)
        await redis.delete(replica_stats_key(self.prefix, self.model, self.replica_id))

    async def next_request(self, timeout: float = 10.0) -> GenerateRequest:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = await get_async_redis().xread(
                {requests_stream(self.prefix, self.model): self._cursor}, count=1, block=100
            )
            for _, entries in reply or []:
                entry_id, fields = entries[0]
                self._cursor = entry_id
                return GenerateRequest.decode(fields)
        raise TimeoutError("no request was queued")

    async def queued_count(self) -> int:
        return await get_async_redis().xlen(requests_stream(self.prefix, self.model))

    async def cancels(self) -> list[str]:
        entries = await get_async_redis().xrange(cancel_stream(self.prefix, self.model))
        return [cancel_request_id(fields) for _, fields in entries]

    async def emit(self, request_id: str, event: Event) -> None:
        await get_async_redis().xadd(output_stream(self.prefix, request_id), event.encode())

    async def emit_raw(self, request_id: str, fields: dict[str, str]) -> None:
        """Write an entry that is not a valid event (a replica of another protocol version, a bug)."""
        await get_async_redis().xadd(output_stream(self.prefix, request_id), fields)
