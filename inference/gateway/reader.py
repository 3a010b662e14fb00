"""Engine output read for a whole web process: one blocking XREAD per event loop for every request.

Each request waiting on its own blocking XREAD costs the web process a Redis round trip, redis-py's
parsing and an asyncio timeout per request per engine step: at 32 streams, 32 wake-ups a step, on
32 connections. Here one reader task per event loop holds a single XREAD over every stream its
requests wait on, buffers what comes back per stream, and wakes the requests that have something;
an engine step that writes to every stream costs the process one or two reads.

The blocked XREAD also waits on a wake stream of the reader's own: a request that registers a new
stream appends to it, so the read returns and is sent again with the new stream. While Redis is
unreachable the reader keeps every registration and position and tries again with backoff (the
requests see reads that time out, and decide how long they wait); any other read error is handed
to every request waiting at that moment, and the registrations are dropped: each request's next
read registers again from its own position, so nothing is skipped or read twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field

from core.redis_client import REDIS_CONNECTION_ERRORS, get_async_redis
from engine.protocol import output_stream

logger = logging.getLogger(__name__)

# Entries per stream per read, as a request's own XREAD took them.
COUNT = 256
# How long the shared read blocks before it is sent again (new streams wake it at once).
BLOCK_MS = 10_000
# A registration that no request has read for this long belongs to a request that ended without
# saying so (its task was killed); it is dropped.
ABANDONED_S = 600.0
WAKE_MAXLEN = 16
WAKE_TTL_S = 3600
# Longest wait between two reads while Redis is unreachable.
RETRY_MAX_S = 1.0

Entry = tuple[bytes, dict[bytes, bytes]]


@dataclass(slots=True, eq=False)
class _Stream:
    request_id: str
    position: bytes  # the last entry id the shared read has taken
    entries: list[Entry] = field(default_factory=list)
    waiter: asyncio.Future | None = None
    read_at: float = field(default_factory=time.monotonic)


class StreamReader:
    """The shared reader of one event loop (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._streams: dict[bytes, _Stream] = {}
        self._wake_key = f"{prefix}out-wake:{uuid.uuid4().hex}".encode()
        self._wake_position = b"0-0"
        self._task: asyncio.Task | None = None
        self.num_reads = 0  # XREAD calls made
        self.num_streams_read = 0  # output streams in the latest XREAD (while one is out: in it)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def _reading(self) -> bool:
        return self._task is not None and not self._task.done()

    async def read(self, positions: dict[str, str], *, block_ms: int) -> list[tuple[str, Entry]]:
        """Entries after `positions` (request id -> last entry id read), oldest first per stream,
        advancing `positions`; [] when nothing came within `block_ms`."""
        streams: list[_Stream] = []
        registered = False
        for request_id, last in positions.items():
            key = output_stream(self.prefix, request_id).encode()
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = _Stream(request_id, last.encode())
                registered = True
            streams.append(stream)
        if not any(s.entries for s in streams):
            # The waiter is in place before the reader is woken: a read that fails at once (a
            # stream of the wrong type) must find it, or its error would reach no one.
            waiter = asyncio.get_running_loop().create_future()
            for stream in streams:
                stream.waiter = waiter
            try:
                if registered:
                    await self._wake_or_start()
                await asyncio.wait([waiter], timeout=block_ms / 1000)
            finally:
                for stream in streams:
                    if stream.waiter is waiter:
                        stream.waiter = None
            if waiter.done() and isinstance(waiter.result(), BaseException):
                raise waiter.result()
        elif registered:
            await self._wake_or_start()
        now = time.monotonic()
        out: list[tuple[str, Entry]] = []
        for stream in streams:
            stream.read_at = now
            if stream.entries:
                out.extend((stream.request_id, entry) for entry in stream.entries)
                stream.entries = []
                positions[stream.request_id] = out[-1][1][0].decode()
        return out

    async def forget(self, request_ids: list[str]) -> None:
        """Stop reading these requests' streams (they ended)."""
        for request_id in request_ids:
            self._streams.pop(output_stream(self.prefix, request_id).encode(), None)
        if not self._streams and self._reading:
            await self._wake()  # the reader ends instead of holding a connection in a read

    async def _wake_or_start(self) -> None:
        if self._reading:
            await self._wake()
        else:
            self._task = asyncio.ensure_future(self._run())

    async def _wake(self) -> None:
        try:
            async with get_async_redis().pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {b"wake": b"1"}, maxlen=WAKE_MAXLEN, approximate=True)
                pipe.expire(self._wake_key, WAKE_TTL_S)
                await pipe.execute()
        except REDIS_CONNECTION_ERRORS:
            pass  # the blocked read fails too, and its retry reads every registered stream

    async def _run(self) -> None:
        redis = get_async_redis()
        restart = True
        delay, lost_at = 0.05, None
        try:
            while self._streams:
                keys = {self._wake_key: self._wake_position}
                keys.update((key, stream.position) for key, stream in self._streams.items())
                self.num_reads += 1
                self.num_streams_read = len(keys) - 1
                try:
                    reply = await redis.xread(keys, count=COUNT, block=BLOCK_MS)
                except REDIS_CONNECTION_ERRORS as exc:
                    if lost_at is None:
                        lost_at = time.monotonic()
                        logger.warning("Redis is unreachable (%s); %d streams wait", exc, len(self._streams))
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
                    continue
                if lost_at is not None:
                    logger.warning("Redis answers again after %.1f s", time.monotonic() - lost_at)
                    delay, lost_at = 0.05, None
                for key, entries in reply or []:
                    if not entries:
                        continue
                    if key == self._wake_key:
                        self._wake_position = entries[-1][0]
                        continue
                    stream = self._streams.get(key)
                    if stream is None:  # forgotten while the read was out
                        continue
                    stream.position = entries[-1][0]
                    stream.entries.extend(entries)
                    if stream.waiter is not None and not stream.waiter.done():
                        stream.waiter.set_result(None)
                self._drop_abandoned()
        except Exception as exc:
            # Every waiting request hears of it; the others meet it on their next read, which
            # registers their streams again from their own positions.
            for stream in self._streams.values():
                if stream.waiter is not None and not stream.waiter.done():
                    stream.waiter.set_result(exc)
            self._streams.clear()
        except asyncio.CancelledError:  # the loop is closing
            restart = False
            raise
        finally:
            self._task = None
            if restart and self._streams:  # registered after the loop's last check: read on
                self._task = asyncio.ensure_future(self._run())

    def _drop_abandoned(self) -> None:
        cutoff = time.monotonic() - ABANDONED_S
        for key in [k for k, s in self._streams.items() if s.read_at < cutoff and s.waiter is None]:
            del self._streams[key]


# Each event loop's readers, by prefix; they go with their loop.
_readers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, StreamReader]] = (
    weakref.WeakKeyDictionary()
)


def get_stream_reader(prefix: str) -> StreamReader:
    """The running event loop's reader of `prefix`'s output streams."""
    readers = _readers.setdefault(asyncio.get_running_loop(), {})
    reader = readers.get(prefix)
    if reader is None:
        reader = readers[prefix] = StreamReader(prefix)
    return reader
