"""Queue generate requests, read their output streams and signal aborts (asyncio Redis client)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from django.conf import settings

from core.redis_client import get_async_redis
from engine.protocol import (
    Event,
    GenerateRequest,
    cancel_message,
    cancel_stream,
    output_stream,
    requests_stream,
)

# Cancel streams are read by every replica from where it joined; old entries only cost memory.
CANCEL_STREAM_MAXLEN = 10_000


class EngineGateway:
    def __init__(self, *, prefix: str) -> None:
        self.prefix = prefix

    async def submit(self, request: GenerateRequest) -> None:
        await get_async_redis().xadd(requests_stream(self.prefix, request.model), request.encode())

    async def cancel(self, *, model: str, request_ids: Iterable[str]) -> None:
        redis = get_async_redis()
        async with redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.xadd(
                    cancel_stream(self.prefix, model),
                    cancel_message(request_id),
                    maxlen=CANCEL_STREAM_MAXLEN,
                    approximate=True,
                )
            await pipe.execute()

    async def read(
        self, positions: dict[str, str], *, block_ms: int, count: int = 256
    ) -> list[tuple[str, Event]]:
        """Events after `positions` (request id -> last stream entry id read), advancing them.

        Blocks up to `block_ms` when nothing is there yet; returns [] on timeout.
        """
        streams = {output_stream(self.prefix, rid): last for rid, last in positions.items()}
        reply = await get_async_redis().xread(streams, count=count, block=block_ms)
        # redis-py's asyncio client sometimes swallows a cancellation that lands inside a blocking
        # read, which then returns as if nothing happened: the stream of a client that went away
        # would run to its end, unaborted. A swallowed cancel leaves the task's count raised.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError()
        events: list[tuple[str, Event]] = []
        start = len(self.prefix) + len("out:")
        for stream, entries in reply or []:
            request_id = (stream.decode() if isinstance(stream, bytes) else stream)[start:]
            for entry_id, fields in entries:
                positions[request_id] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                events.append((request_id, Event.decode(fields)))
        return events


def get_gateway() -> EngineGateway:
    return EngineGateway(prefix=settings.REDIS_PREFIX)
