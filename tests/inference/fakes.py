"""A scripted stand-in for an engine replica, speaking engine/protocol.py over the real Redis.

It tests the web side's handling of the protocol; the e2e tests run the real engine worker.
"""

from __future__ import annotations

import asyncio
import time

from django.conf import settings

from engine.protocol import (
    DeltaOutput,
    Event,
    FinishedOutput,
    GenerateRequest,
    ReplicaStats,
    Usage,
    cancel_request_id,
    cancel_stream,
    output_stream,
    replica_stats_key,
    replicas_key,
    requests_stream,
)
from tenants.redis_client import get_async_redis


class FakeEngine:
    def __init__(self, model: str, replica_id: str = "fake-1") -> None:
        self.model = model
        self.replica_id = replica_id
        self.prefix = settings.REDIS_PREFIX
        self._cursor = "0-0"

    async def heartbeat(self, *, num_free_blocks: int = 10, **stats) -> None:
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
        )
        await redis.set(replica_stats_key(self.prefix, self.model, self.replica_id), body.encode(), ex=30)
        await redis.zadd(replicas_key(self.prefix, self.model), {self.replica_id: time.time()})

    async def stop_heartbeat(self) -> None:
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

    async def reply(
        self,
        request: GenerateRequest,
        pieces: list[tuple[str, list[int]]],
        *,
        finish_reason: str = "stop",
        cached_tokens: int = 0,
        logprobs: bool = False,
        delay: float = 0.0,
    ) -> None:
        """Stream `pieces` (text, token ids) to every index, then finish with usage."""
        n = int(request.sampling_params.get("n", 1))
        for text, token_ids in pieces:
            outputs = [
                DeltaOutput(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    logprobs=[{"token_id": t, "logprob": -0.5, "top": [[t, -0.5], [t + 1, -1.5]]} for t in token_ids]
                    if logprobs
                    else None,
                )
                for i in range(n)
            ]
            await self.emit(request.request_id, Event.delta(outputs))
            if delay:
                await asyncio.sleep(delay)
        produced = sum(len(ids) for _, ids in pieces) * n
        usage = Usage(len(request.prompt_token_ids), produced, cached_tokens)
        finished = Event.finished([FinishedOutput(i, finish_reason) for i in range(n)], usage)
        finished.replica = self.replica_id
        await self.emit(request.request_id, finished)

    async def serve_one(self, pieces: list[tuple[str, list[int]]], **kwargs) -> GenerateRequest:
        request = await self.next_request()
        await self.reply(request, pieces, **kwargs)
        return request
