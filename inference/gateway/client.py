"""Queue generate requests, read their output streams and signal aborts (asyncio Redis client)."""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings

from core.errors import ServiceUnavailableError
from core.redis_client import get_async_redis
from engine.protocol import (
    Event,
    GenerateRequest,
    cancel_message,
    cancel_stream,
    entry_gap,
    requests_stream,
)
from inference.gateway.reader import get_stream_reader

# Cancel streams are read by every replica from where it joined; old entries only cost memory.
CANCEL_STREAM_MAXLEN = 10_000


class EngineGateway:
    def __init__(self, *, prefix: str) -> None:
        self.prefix = prefix
        self._interrupted = False  # a read found entries missing from an output stream

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

    async def read(self, positions: dict[str, str], *, block_ms: int) -> list[tuple[str, Event]]:
        """Events after `positions` (request id -> last stream entry id read), advancing them.

        Blocks up to `block_ms` when nothing is there yet; returns [] on timeout. The streams are
        read by the event loop's shared reader (inference.gateway.reader) until `forget`. When
        entries are missing between two that were read (Redis lost its last writes in a restart),
        the events before the hole are returned and the next read raises ServiceUnavailableError
        (stream_interrupted).
        """
        if self._interrupted:
            raise ServiceUnavailableError(
                "Part of this response was lost when the engines' queue restarted; the request was "
                "stopped and is billed for what was sent.",
                code="stream_interrupted",
            )
        before = dict(positions)
        entries = await get_stream_reader(self.prefix).read(positions, block_ms=block_ms)
        events = []
        for request_id, (entry_id, fields) in entries:
            last = before.get(request_id)
            if entry_gap(None if last in (None, "0-0") else last, entry_id):
                self._interrupted = True
                break
            before[request_id] = entry_id
            events.append((request_id, Event.decode(fields)))
        return events

    async def forget(self, request_ids: Iterable[str]) -> None:
        """The requests ended: their streams are read no more."""
        await get_stream_reader(self.prefix).forget(list(request_ids))


def get_gateway() -> EngineGateway:
    """A gateway for one generation (it remembers whether that generation's streams lost entries)."""
    return EngineGateway(prefix=settings.REDIS_PREFIX)
