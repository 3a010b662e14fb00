"""How much work a model's engines have before them: read off its Redis request streams.

`waiting`: requests queued and not yet taken by any replica: the consumer group's lag, summed over
the model's shared stream and the replicas' own streams (prefix routing). `pending`: taken by a
replica and not finished: the group's pending entries. An autoscaler reads these (the `/metrics`
gauges pagoda_queue_depth and pagoda_queue_pending; KEDA's redis-streams trigger reads the lag and
pending count of the shared stream itself).

Redis 7 keeps each group's lag (XINFO GROUPS). Where it has none (Redis 6.2, the embedded server;
or undeterminable after entries past the group's last-delivered id were deleted), the entries past
that id are counted, at most COUNT_CAP a stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from django.conf import settings

from core.redis_client import get_redis
from engine.protocol import CONSUMER_GROUP, request_streams, routes_key

# Counting entries one by one (no lag from Redis) stops here: an autoscaler needs "many", not the
# exact figure, and a scrape must stay cheap.
COUNT_CAP = 10_000


@dataclass(frozen=True, slots=True)
class QueueDepth:
    waiting: int
    pending: int


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _stream_depth(client: redis.Redis, stream: str) -> QueueDepth:
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream (never written, or retired): nothing in it
        return QueueDepth(0, 0)
    for group in groups:
        if _text(group["name"]) != CONSUMER_GROUP:
            continue
        lag = group.get("lag")
        if lag is None:
            last = _text(group["last-delivered-id"])
            lag = len(client.xrange(stream, min=f"({last}", max="+", count=COUNT_CAP))
        return QueueDepth(int(lag), int(group["pending"]))
    # No replica ever read it: every entry waits.
    return QueueDepth(min(int(client.xlen(stream)), COUNT_CAP), 0)


def queue_depth(model: str) -> QueueDepth:
    """The model's waiting and pending requests over all its request streams."""
    client = get_redis()
    prefix = settings.REDIS_PREFIX
    streams = request_streams(prefix, model, client.smembers(routes_key(prefix, model)))
    depths = [_stream_depth(client, stream) for stream in streams]
    return QueueDepth(sum(d.waiting for d in depths), sum(d.pending for d in depths))
