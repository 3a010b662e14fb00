"""The replica's watch for more important requests while its steps run (engine.step_interrupt).

A thread reads the model's shared request stream and the replica's own as a plain reader (XREAD,
not the consumer group: it takes nothing, the worker loop still reads and claims every entry) and
sets `arrived` when an entry's tier is more important than the spare-capacity tier. The worker
clears it before each read of new requests; a spare-capacity step that sees it set between layers
is given up, so that the next step computes the new request's prompt.

A missed entry costs nothing but the interrupt (the request waits for the step, as it would
without the watch); an entry seen twice sets the event twice.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import orjson
import redis

from engine.step_interrupt import SPARE_CAPACITY_PRIORITY
from engine.worker.queue import CONNECTION_ERRORS, entries_of

logger = logging.getLogger(__name__)

# How long one read blocks: the thread sees a stop this often while nothing arrives.
BLOCK_MS = 1000
# How long it waits before reading again after Redis failed to answer.
RETRY_S = 0.5


def more_important(fields: dict[Any, Any]) -> bool:
    """Whether a request entry's tier is more important than the spare-capacity tier (False for
    an entry it cannot read: the worker loop answers those)."""
    data = fields.get(b"data", fields.get("data"))
    if not isinstance(data, bytes | str):
        return False
    try:
        raw = orjson.loads(data)
    except ValueError:
        return False
    priority = raw.get("priority") if isinstance(raw, dict) else None
    return isinstance(priority, int) and priority < SPARE_CAPACITY_PRIORITY


class ArrivalWatch:
    def __init__(self, client: redis.Redis, streams: list[str], arrived: threading.Event) -> None:
        # Its own connection from the client's pool: a blocking read holds one.
        self.client = redis.Redis(connection_pool=client.connection_pool)
        self.streams = streams
        self.arrived = arrived
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arrival-watch", daemon=True)
        self.num_read = 0  # entries read
        self.num_seen = 0  # more important entries among them

    def start(self) -> ArrivalWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BLOCK_MS / 1000)

    def _run(self) -> None:
        # "$": entries added after the first read starts; then after the last one seen.
        last: dict[Any, Any] = dict.fromkeys(self.streams, "$")
        while not self._stop.is_set():
            try:
                answer = self.client.xread(last, block=BLOCK_MS)
            except CONNECTION_ERRORS:
                self._stop.wait(RETRY_S)
                continue
            except redis.RedisError:
                logger.exception("the arrival watch failed to read the request streams")
                self._stop.wait(RETRY_S)
                continue
            for ref, fields in entries_of(answer):
                last[ref.stream] = ref.id
                self.num_read += 1
                if more_important(fields):
                    self.num_seen += 1
                    self.arrived.set()
