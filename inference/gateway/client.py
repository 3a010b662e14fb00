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
    replica_requests_stream,
    requests_stream,
)
from inference.gateway import routing
from inference.gateway.reader import get_stream_reader
from inference.gateway.routing import RouteHint

# Cancel streams are read by every replica from where it joined; old entries only cost memory.
CANCEL_STREAM_MAXLEN = 10_000
# How long the marker of a request queued once is kept (longer than a batch's completion window).
SUBMITTED_TTL_S = 2 * 24 * 3600
# KEYS: the marker (once), the chosen replica's stream, the model's shared stream, then the prefix
# index entries to point at the replica; ARGV: once (1 or 0), the marker's TTL, the index entries'
# TTL, the replica, then the request's fields. A replica's stream is used only while it exists (a
# replica that left deleted it): else the shared stream. Returns 0 when the request was queued
# once before.
_SUBMIT = """
if ARGV[1] == '1' and not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[2]) then
  return 0
end
local stream = KEYS[3]
if KEYS[2] ~= KEYS[3] and redis.call('EXISTS', KEYS[2]) == 1 then
  stream = KEYS[2]
end
for i = 4, #KEYS do
  redis.call('SET', KEYS[i], ARGV[4], 'EX', ARGV[3])
end
redis.call('XADD', stream, '*', unpack(ARGV, 5))
return 1
"""


def submitted_key(prefix: str, request_id: str) -> str:
    return f"{prefix}submitted:{request_id}"


class EngineGateway:
    def __init__(self, *, prefix: str) -> None:
        self.prefix = prefix
        self._interrupted = False  # a read found entries missing from an output stream
        self._routed: dict[str, tuple[str, str]] = {}  # request id -> (model, replica), until forgotten

    async def submit(
        self, request: GenerateRequest, *, once: bool = False, route: RouteHint | None = None
    ) -> None:
        """Queue the request: to the replica `route` picks (inference.gateway.routing), else to the
        model's shared stream. `once`: only if no request of this id was ever queued with `once` (a
        marker kept for a day, set with the queueing in one script), so that work resumed after a
        crash never queues a request twice; see `was_submitted`."""
        shared = requests_stream(self.prefix, request.model)
        chosen = None
        if route is not None and request.task == "generate":
            chosen = await routing.route(
                model=request.model,
                salt=f"{request.cache_salt or ''}\0{request.lora.name if request.lora else ''}",
                prompt_token_ids=request.prompt_token_ids,
                hint=route,
            )
        if chosen is None and not once:
            await get_async_redis().xadd(shared, request.encode())
            return
        target = (
            shared if chosen is None else replica_requests_stream(self.prefix, request.model, chosen.replica)
        )
        index_keys = chosen.index_keys if chosen is not None else ()
        fields = [item for pair in request.encode().items() for item in pair]
        if chosen is not None:
            # Counted before the queueing: a failed one is still forgotten by the caller.
            routing.routed(request.model, chosen.replica)
            self._routed[request.request_id] = (request.model, chosen.replica)
        await get_async_redis().eval(
            _SUBMIT,
            3 + len(index_keys),
            submitted_key(self.prefix, request.request_id),
            target,
            shared,
            *index_keys,
            "1" if once else "0",
            SUBMITTED_TTL_S,
            routing.PREFIX_INDEX_TTL_S,
            chosen.replica if chosen is not None else "",
            *fields,
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
        ids = list(request_ids)
        for request_id in ids:
            if (routed := self._routed.pop(request_id, None)) is not None:
                routing.ended(*routed)
        await get_stream_reader(self.prefix).forget(ids)


def get_gateway() -> EngineGateway:
    """A gateway for one generation (it remembers whether that generation's streams lost entries)."""
    return EngineGateway(prefix=settings.REDIS_PREFIX)
