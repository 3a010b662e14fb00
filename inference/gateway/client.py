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
# How long the marker of a request queued once is kept (longer than a batch's completion window).
SUBMITTED_TTL_S = 2 * 24 * 3600
# KEYS: the marker, the request stream; ARGV: the marker's TTL, then the request's fields.
_SUBMIT_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
  return 1
end
return 0
"""


def submitted_key(prefix: str, request_id: str) -> str:
    return f"{prefix}submitted:{request_id}"


class EngineGateway:
    def __init__(self, *, prefix: str) -> None:
        self.prefix = prefix
        self._interrupted = False  # a read found entries missing from an output stream

    async def submit(self, request: GenerateRequest, *, once: bool = False) -> None:
        """Queue the request. `once`: only if no request of this id was ever queued with `once`
        (a marker kept for a day, set with the queueing in one script), so that work resumed after
        a crash never queues a request twice; see `was_submitted`."""
        stream = requests_stream(self.prefix, request.model)
        if not once:
            await get_async_redis().xadd(stream, request.encode())
            return
        fields = [item for pair in request.encode().items() for item in pair]
        await get_async_redis().eval(
            _SUBMIT_ONCE, 2, submitted_key(self.prefix, request.request_id), stream, SUBMITTED_TTL_S, *fields
        )

    async def was_submitted(self, request_id: str) -> bool:
        """Whether a request of this id was queued with `submit(once=True)` (within a day)."""
        return bool(await get_async_redis().exists(submitted_key(self.prefix, request_id)))

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
