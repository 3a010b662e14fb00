"""The Redis side of a replica: its model's request streams (one consumer group each), cancels,
outputs, heartbeat.

A model's requests are in its shared stream and in one stream per replica (requests the web tier
routed to that replica by prefix, inference.gateway.routing). A replica reads its own stream, then
the shared one; an idle one steals from other replicas' streams what waited there past the steal
delay; a replica that leaves moves what nobody read from its stream to the shared one, and the
stream of a replica whose heartbeat lapsed is moved the same way by the others. Reclaim, orphan
claims, touches, acks and hand-backs work on every stream: an entry is known by its stream and id
(EntryRef).

Most calls here are one round trip; the worker loop decides when to make them.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import redis

from engine.protocol import (
    CONSUMER_GROUP,
    Event,
    ReplicaStats,
    cancel_request_id,
    cancel_stream,
    output_stream,
    replica_requests_stream,
    replica_stats_key,
    replicas_key,
    request_streams,
    requests_stream,
    routes_key,
    usage_key,
)
from engine.worker.scripts import (
    ACK_OWNED_SCRIPT,
    HAND_BACK_SCRIPT,
    READ_NEW_SCRIPT,
    RETIRE_SCRIPT,
    STEAL_SCRIPT,
    TAKE_OVER_SCRIPT,
    TOUCH_SCRIPT,
)


class EntryRef(NamedTuple):
    """A request entry: the stream it is in (the model's shared stream or a replica's own) and its id."""

    stream: str
    id: bytes


Entry = tuple[EntryRef, dict[bytes, bytes]]
Claimed = tuple[EntryRef, dict[bytes, bytes], int]  # with how often it was delivered

# Redis unreachable (down, restarting, a network blip): the worker waits for it, keeping its work.
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)

# Output streams whose TTL refresh is tracked before those untouched for a whole TTL are dropped.
_EXPIRE_TRACKED_MAX = 4096
# A request's usage record (its last event) outlives its output stream: a settler bills from it
# when the web process that took the request is gone.
USAGE_TTL_MIN_S = 3600


# Idle time given to entries handed back on a failure, so the next XAUTOCLAIM of any replica
# takes them at once instead of after the claim timeout.
_RELEASED_IDLE_MS = 10**12


# An entry of a replica whose heartbeat lapsed is taken only when idle this long: two live replicas
# looking at once both try, and the first claim resets the idle time the second one needs.
ORPHAN_MIN_IDLE_MS = 1000


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _stream_id(value: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(value).partition("-")
    return int(ms), int(seq or 0)


# Cancels read at most at once (the rest on the next read).
CANCELS_READ_MAX = 1000


class ReadAhead(NamedTuple):
    """What a publish read for the next step: new entries (None: read them again) and cancels."""

    entries: list[Entry] | None
    cancels: list[str]


class RequestQueue:
    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str,
        model: str,
        replica_id: str,
        output_ttl_s: int,
        heartbeat_ttl_s: float,
    ) -> None:
        self.client = client
        self.model = model
        self.replica_id = replica_id
        self.prefix = prefix
        self.stream = requests_stream(prefix, model)  # shared by the model's replicas
        self.own_stream = replica_requests_stream(prefix, model, replica_id)
        self.routes = routes_key(prefix, model)
        self.cancels = cancel_stream(prefix, model)
        self.output_ttl_s = output_ttl_s
        self._expire_set_at: dict[str, float] = {}  # output stream -> when its TTL was last set
        self.heartbeat_ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self._touch = client.register_script(TOUCH_SCRIPT)
        self._hand_back = client.register_script(HAND_BACK_SCRIPT)
        self._take_over = client.register_script(TAKE_OVER_SCRIPT)
        self._steal = client.register_script(STEAL_SCRIPT)
        self._retire = client.register_script(RETIRE_SCRIPT)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._autoclaim_cursors: dict[str, bytes | str] = {}
        self._cancel_cursor: bytes | str = "0-0"
        # Output stream entry ids of the requests this replica writes to: [stamp ms, next number].
        self._entry_ids: dict[str, list[int]] = {}
        # A batch whose round trip failed (Redis went away), with the entry ids it was given: sent
        # again, as it was, before anything newer.
        self._unsent: list[tuple[str, Event, str]] = []
        self._unsent_acks: list[EntryRef] = []
        # Since start: entries taken from this replica's own stream, and stolen from others'.
        self.num_routed = 0
        self.num_stolen = 0

    # --- requests -------------------------------------------------------------------------------

    def ensure_group(self) -> None:
        # From id 0, not "$": requests queued before the first replica ever started are served too.
        for stream in (self.stream, self.own_stream):
            try:
                self.client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self.client.sadd(self.routes, self.replica_id)

    def streams(self) -> list[str]:
        """Every request stream of the model: the shared one, this replica's, the other replicas'."""
        others = sorted(_text(r) for r in self.client.smembers(self.routes) if _text(r) != self.replica_id)
        return [
            self.stream,
            self.own_stream,
            *(replica_requests_stream(self.prefix, self.model, r) for r in others),
        ]

    def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` entries nobody has read: this replica's own first, then the shared stream's;
        when both are empty, a read of both that blocks up to `block_ms` (None: none)."""
        return self._read(count, block_ms, cancels=False)[0]

    def read_turn(self, count: int, block_ms: int | None) -> ReadAhead:
        """What a turn of the loop reads before it steps: the new entries, as `read_new`, and the
        cancels, as `read_cancels`, each cancel read in the same round trip as a read of entries. A
        replica woken from its blocking read by a request steps at once, with the cancels read
        after that request arrived (the read made three round trips before a step, now two)."""
        return ReadAhead(*self._read(count, block_ms, cancels=True))

    def _read(self, count: int, block_ms: int | None, *, cancels: bool) -> tuple[list[Entry], list[str]]:
        keys = [self.own_stream, self.stream]
        cancel_ids: list[str] = []

        def read(add: Callable[[Any], Any]) -> Any:
            pipe = self.client.pipeline(transaction=False)
            add(pipe)
            if cancels:
                self._pipe_read_cancels(pipe)
            results = pipe.execute(raise_on_error=False)
            for result in results:
                if isinstance(result, redis.ConnectionError | redis.TimeoutError):
                    raise result
            if cancels:
                cancel_ids.extend(self._cancels_read(results[1]))
            return results[0]

        def unread(pipe: Any) -> None:
            self._pipe_read_new(pipe, count)

        entries = self._new_read(read(unread))
        if entries is None:
            # Taken for a lost replica while this one stalled, its stream was retired; made again: read once more.
            entries = self._new_read(read(unread)) or []
        if not entries and block_ms is not None:
            reply = read(
                lambda pipe: pipe.xreadgroup(
                    CONSUMER_GROUP, self.replica_id, {key: ">" for key in keys}, count=count, block=block_ms
                )
            )
            if isinstance(reply, redis.ResponseError) and _no_group(reply):
                self.ensure_group()  # retired a moment ago (see above); read again next time
                reply = None
            elif isinstance(reply, Exception):
                raise reply
            entries = self._routed(entries_of(reply))
        return entries, cancel_ids

    # The reads a turn makes before it steps, added to a pipeline that may carry other commands (a
    # blocking read's, or a step's publish), and what their replies give.

    def _pipe_read_new(self, pipe: Any, count: int) -> None:
        # EVAL, not the registered script: a pipeline checks its scripts exist in a round trip of
        # its own first.
        pipe.eval(READ_NEW_SCRIPT, 2, self.own_stream, self.stream, CONSUMER_GROUP, self.replica_id, count)

    def _pipe_read_cancels(self, pipe: Any) -> None:
        pipe.xread({self.cancels: self._cancel_cursor}, count=CANCELS_READ_MAX)

    def _new_read(self, reply: Any) -> list[Entry] | None:
        """The entries of `_pipe_read_new`'s reply; None when this replica's stream was retired (its
        group is made again, and the caller reads again)."""
        if isinstance(reply, redis.ResponseError) and _no_group(reply):
            self.ensure_group()
            return None
        if isinstance(reply, Exception):
            raise reply
        own, shared = reply
        return self._routed([*_script_entries(self.own_stream, own), *_script_entries(self.stream, shared)])

    def _cancels_read(self, reply: Any) -> list[str]:
        if isinstance(reply, Exception):
            raise reply
        return self._cancel_ids(reply)

    def _routed(self, entries: list[Entry]) -> list[Entry]:
        self.num_routed += sum(1 for ref, _ in entries if ref.stream == self.own_stream)
        return entries

    def steal(self, count: int, min_age_ms: int) -> list[Entry]:
        """Entries routed to other replicas that nobody read for `min_age_ms` (their replica is
        busy, stalled or gone), oldest first, up to `count`."""
        cutoff = f"{max(0, int(time.time() * 1000) - min_age_ms)}-{2**64 - 1}"
        stolen: list[Entry] = []
        for stream in self.streams()[2:]:
            if len(stolen) >= count:
                break
            rows = self._steal(
                keys=[stream], args=[CONSUMER_GROUP, self.replica_id, cutoff, count - len(stolen)]
            )
            stolen.extend(_script_entries(stream, rows))
        self.num_stolen += len(stolen)
        return stolen

    def read_own_pending(self, count: int) -> list[Claimed]:
        """Entries still held under this replica id by an earlier process of the same id."""
        entries: list[Entry] = []
        for stream in self.streams():
            if len(entries) >= count:
                break
            try:
                reply = self.client.xreadgroup(
                    CONSUMER_GROUP, self.replica_id, {stream: "0"}, count=count - len(entries)
                )
            except redis.ResponseError as exc:
                if not _no_group(exc):
                    raise
                continue  # a stream retired meanwhile
            entries.extend(entries_of(reply))
        return self._with_deliveries(entries)

    def autoclaim(self, min_idle_ms: int, count: int) -> list[Claimed]:
        """Claim entries idle past the timeout (their replica died); with how often each was delivered."""
        claimed: list[Entry] = []
        for stream in self.streams():
            if len(claimed) >= count:
                break
            try:
                reply = self.client.xautoclaim(
                    stream,
                    CONSUMER_GROUP,
                    self.replica_id,
                    min_idle_ms,
                    self._autoclaim_cursors.get(stream, "0-0"),
                    count=count - len(claimed),
                )
            except redis.ResponseError as exc:
                if not _no_group(exc):
                    raise
                continue
            self._autoclaim_cursors[stream] = reply[0]
            # Entries trimmed from the stream while pending are listed apart (Redis 7); Redis deletes
            # them from the group itself.
            claimed.extend((EntryRef(stream, _b(mid)), fields or {}) for mid, fields in reply[1])
        return self._with_deliveries(claimed)

    def claim_orphans(self, count: int) -> list[Claimed]:
        """Claim the entries held by replicas whose heartbeat lapsed (dead, or cut off from Redis),
        at once rather than after the claim timeout; with how often each was delivered. The
        entries nobody read from such a replica's own stream go to the shared stream, and its
        stream is deleted once nothing in it is pending (RETIRE_SCRIPT)."""
        streams = self.streams()
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(replicas_key(self.prefix, self.model), time.time() - self.heartbeat_ttl_s, "+inf")
        for stream in streams:
            pipe.xpending(stream, CONSUMER_GROUP)
        live_ids, *summaries = pipe.execute(raise_on_error=False)
        if isinstance(live_ids, Exception):
            raise live_ids
        live = {_text(r) for r in live_ids} | {self.replica_id}
        for replica in sorted({_text(r) for r in self.client.smembers(self.routes)} - live):
            self.retire(replica)
        claimed: list[Entry] = []
        for stream, summary in zip(streams, summaries, strict=True):
            if isinstance(summary, redis.ResponseError):
                continue  # NOGROUP: retired meanwhile
            if isinstance(summary, Exception):
                raise summary
            orphaned = [
                _text(c["name"]) for c in summary.get("consumers") or () if _text(c["name"]) not in live
            ]
            for consumer in orphaned:
                if len(claimed) >= count:
                    break
                rows = self.client.xpending_range(
                    stream, CONSUMER_GROUP, "-", "+", count - len(claimed), consumername=consumer
                )
                if not rows:
                    continue
                reply: list[Any] = self.client.xclaim(
                    stream,
                    CONSUMER_GROUP,
                    self.replica_id,
                    ORPHAN_MIN_IDLE_MS,
                    [row["message_id"] for row in rows],
                )
                # An entry trimmed while pending comes back without fields; Redis drops it from the group.
                claimed.extend((EntryRef(stream, _b(mid)), fields) for mid, fields in reply if fields)
        return self._with_deliveries(claimed)

    def retire(self, replica_id: str) -> int:
        """A replica's own stream, as it leaves (or after it was lost): what nobody read goes to the
        shared stream at once; the stream is deleted once nothing in it is pending. Returns how
        many entries were moved."""
        stream = replica_requests_stream(self.prefix, self.model, replica_id)
        return int(self._retire(keys=[stream, self.stream, self.routes], args=[CONSUMER_GROUP, replica_id]))

    def _with_deliveries(self, entries: list[Entry]) -> list[Claimed]:
        if not entries:
            return []
        pipe = self.client.pipeline(transaction=False)
        for ref, _ in entries:
            pipe.xpending_range(ref.stream, CONSUMER_GROUP, ref.id, ref.id, 1)
        deliveries = [rows[0]["times_delivered"] if rows else 1 for rows in pipe.execute()]
        return [(ref, fields, d) for (ref, fields), d in zip(entries, deliveries, strict=True)]

    def touch(self, refs: list[EntryRef]) -> set[EntryRef]:
        """Reset the idle time of entries this replica holds; returns those it still owns."""
        owned: set[EntryRef] = set()
        for stream, ids in _by_stream(refs).items():
            still = self._touch(keys=[stream], args=[CONSUMER_GROUP, self.replica_id, *ids])
            owned.update(EntryRef(stream, _b(mid)) for mid in still)
        return owned

    def hand_back(self, refs: list[EntryRef]) -> set[EntryRef]:
        """Give unstarted entries back at once, as new entries of the shared stream that any replica
        reads next (their delivery counts start again); returns those handed back (the ones still ours)."""
        handed: set[EntryRef] = set()
        for stream, ids in _by_stream(refs).items():
            done = self._hand_back(keys=[stream, self.stream], args=[CONSUMER_GROUP, self.replica_id, *ids])
            handed.update(EntryRef(stream, _b(mid)) for mid in done)
        return handed

    def release(self, refs: list[EntryRef]) -> None:
        """Hand entries back unanswered, claimable at once by any replica's next XAUTOCLAIM, which
        counts the delivery (the guard against a request that kills every replica taking it)."""
        for stream, ids in _by_stream(refs).items():
            self.client.xclaim(
                stream,
                CONSUMER_GROUP,
                self.replica_id,
                0,
                list[Any](ids),  # redis-py's stubs take a list of any id type (lists are invariant)
                idle=_RELEASED_IDLE_MS,
                justid=True,
            )

    def leave_group(self) -> None:
        """On a clean exit: this replica's own stream is retired, and it leaves each stream's group
        where it holds nothing, so nothing is dropped."""
        self.retire(self.replica_id)
        for stream in self.streams():
            try:
                rows = self.client.xpending_range(
                    stream, CONSUMER_GROUP, "-", "+", 1, consumername=self.replica_id
                )
                if not rows:
                    self.client.xgroup_delconsumer(stream, CONSUMER_GROUP, self.replica_id)
            except redis.ResponseError:
                continue  # retired: its group went with it

    # --- outputs --------------------------------------------------------------------------------

    def _entry_id(self, request_id: str, event: Event) -> str:
        stamp = self._entry_ids.get(request_id)
        if stamp is None:
            stamp = self._entry_ids[request_id] = [int(time.time() * 1000), 0]
        entry_id = f"{stamp[0]}-{stamp[1]}"
        stamp[1] += 1
        if event.type != "delta":
            del self._entry_ids[request_id]
        return entry_id

    def publish(
        self, events: list[tuple[str, Event]], acks: list[EntryRef], *, read_ahead: int = 0
    ) -> ReadAhead | None:
        """All of one step's events and acks in one round trip; acks go last so nothing is acked unsent.

        Each event gets its entry id here, once. When the round trip fails (a ConnectionError
        raised to the caller), the batch is kept and sent again first by the next call: entries
        Redis had already taken are refused as duplicates, so nothing is written twice.

        `read_ahead` > 0: the same round trip then reads what the next step needs, as `read_new`
        (without blocking) up to that many entries, and `read_cancels` would, and returns it (None
        when its read of new entries found a stream retired: the next call of `read_new` reads
        again). A replica still running requests after a step makes one round trip between steps
        instead of three."""
        batch = self._unsent + [(rid, event, self._entry_id(rid, event)) for rid, event in events]
        acks = self._unsent_acks + acks
        if not batch and not acks and read_ahead <= 0:
            return None
        self._unsent, self._unsent_acks = batch, acks
        pipe = self.client.pipeline(transaction=False)
        now = time.monotonic()
        refresh_after = now - max(1.0, self.output_ttl_s / 4)
        expire: set[str] = set()
        xadds: list[int] = []
        for request_id, event, entry_id in batch:
            key = output_stream(self.prefix, request_id)
            data: dict[Any, Any] = event.encode()  # redis-py stubs' key and value types (invariant)
            xadds.append(len(pipe))
            pipe.xadd(key, data, id=entry_id)
            # The TTL is set on a stream's first entry and refreshed while it runs (a request
            # longer than the TTL keeps its stream), not on every token; and on its last entry, so
            # that a finished stream stays replayable for the whole TTL after its end.
            if event.type != "delta":
                self._expire_set_at.pop(key, None)
                expire.add(key)
                pipe.set(usage_key(self.prefix, request_id), data["data"], ex=self.usage_ttl_s)
            elif self._expire_set_at.get(key, -math.inf) < refresh_after:
                self._expire_set_at[key] = now
                expire.add(key)
        for key in expire:
            pipe.expire(key, self.output_ttl_s)
        if len(self._expire_set_at) > _EXPIRE_TRACKED_MAX:  # streams that ended without a last entry
            stale = now - self.output_ttl_s
            self._expire_set_at = {k: t for k, t in self._expire_set_at.items() if t >= stale}
            live = {rid for rid, _, _ in batch}
            self._entry_ids = {
                rid: stamp
                for rid, stamp in self._entry_ids.items()
                if rid in live or stamp[0] / 1000 >= time.time() - self.output_ttl_s
            }
        for stream, ids in _by_stream(acks).items():
            # EVAL, not a registered script: a pipeline checks its scripts exist in a round trip
            # of its own first.
            pipe.eval(ACK_OWNED_SCRIPT, 1, stream, CONSUMER_GROUP, self.replica_id, *ids)
        reads = len(pipe)
        if read_ahead > 0:
            self._pipe_read_new(pipe, read_ahead)
            self._pipe_read_cancels(pipe)
        results = pipe.execute(raise_on_error=False)
        self._unsent, self._unsent_acks = [], []
        for index in xadds:
            # "equal or smaller than the target stream top item": sent before the connection was lost.
            result = results[index]
            if isinstance(result, redis.ResponseError) and "equal or smaller" not in str(result):
                raise result
        for result in results:
            if isinstance(result, redis.ConnectionError | redis.TimeoutError):
                raise result
        if read_ahead <= 0:
            return None
        new, cancels = results[reads:]
        cancel_ids = self._cancels_read(cancels)
        return ReadAhead(self._new_read(new), cancel_ids)

    @property
    def num_unsent(self) -> int:
        return len(self._unsent)

    @property
    def usage_ttl_s(self) -> int:
        return max(self.output_ttl_s, USAGE_TTL_MIN_S)

    def trim_answered(self, retention_s: float) -> None:
        """Drop the entries of answered requests older than `retention_s` (their prompts' token ids
        with them) from every request stream of the model. Never an entry still pending in a
        replica or not yet delivered: the cut is at the oldest of those, or at the retention horizon
        if that is older."""
        horizon = (max(0, int((time.time() - retention_s) * 1000)), 0)
        for stream in self.streams():
            try:
                summary = self.client.xpending(stream, CONSUMER_GROUP)
                groups = self.client.xinfo_groups(stream)
            except redis.ResponseError:
                continue  # retired meanwhile
            cut = horizon
            if summary.get("pending"):
                cut = min(cut, _stream_id(summary["min"]))
            for group in groups:
                if _text(group["name"]) == CONSUMER_GROUP:
                    ms, seq = _stream_id(group["last-delivered-id"])
                    cut = min(cut, (ms, seq + 1))
            self.client.xtrim(stream, minid=f"{cut[0]}-{cut[1]}", approximate=False)

    def take_over(self, request_id: str) -> tuple[list[Event], bool]:
        """A request's output stream as it stands, for a replica taking it over; and whether it was
        in the middle of an answer, in which case a failover marker naming this replica now ends it
        (see TAKE_OVER_SCRIPT) and this replica's own events follow the marker."""
        marker = Event.failover(self.replica_id).encode()["data"]
        entries, marker_id = self._take_over(
            keys=[output_stream(self.prefix, request_id)], args=[marker, self.output_ttl_s]
        )
        events = [Event.decode(dict(zip(fields[::2], fields[1::2], strict=True))) for _, fields in entries]
        if not marker_id:
            return events, False
        ms, seq = _stream_id(marker_id)
        self._entry_ids[request_id] = [ms, seq + 1]
        self._expire_set_at[output_stream(self.prefix, request_id)] = time.monotonic()
        return [*events, Event.failover(self.replica_id)], True

    # --- cancels --------------------------------------------------------------------------------

    def start_cancels(self, lookback_s: float) -> None:
        # Stream ids are millisecond timestamps: starting a little in the past also catches cancels
        # sent for requests that this replica will only take later (a reclaim, a queued request).
        self._cancel_cursor = f"{max(0, int((time.time() - lookback_s) * 1000))}-0"

    def read_cancels(self, count: int = CANCELS_READ_MAX) -> list[str]:
        return self._cancel_ids(self.client.xread({self.cancels: self._cancel_cursor}, count=count))

    def _cancel_ids(self, reply: Any) -> list[str]:
        ids: list[str] = []
        for ref, fields in entries_of(reply):
            self._cancel_cursor = ref.id
            request_id = cancel_request_id(fields)
            if request_id:
                ids.append(request_id)
        return ids

    # --- heartbeat ------------------------------------------------------------------------------

    def heartbeat(self, stats: ReplicaStats) -> None:
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.set(
            replica_stats_key(self.prefix, self.model, self.replica_id),
            stats.encode(),
            px=self.heartbeat_ttl_ms,
        )
        pipe.zadd(replicas_key(self.prefix, self.model), {self.replica_id: now})
        # Replicas that vanished without a clean exit leave a member behind; keep the set bounded.
        pipe.zremrangebyscore(replicas_key(self.prefix, self.model), "-inf", now - 3600)
        pipe.execute()

    def remove_heartbeat(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(replica_stats_key(self.prefix, self.model, self.replica_id))
        pipe.zrem(replicas_key(self.prefix, self.model), self.replica_id)
        pipe.execute()


def _no_group(exc: redis.ResponseError) -> bool:
    """Whether Redis answered that the stream or its consumer group is not there (a replica's
    stream retired meanwhile)."""
    return "NOGROUP" in str(exc)


def model_request_streams(client: redis.Redis, prefix: str, model: str) -> list[str]:
    """Every request stream of a model: its shared stream, then each routed replica's own."""
    return request_streams(prefix, model, client.smembers(routes_key(prefix, model)))


def entries_of(reply: Any) -> list[Entry]:
    if not reply:
        return []
    # RESP2 replies: [[stream, [(id, fields), ...]], ...]; fields is None for an entry deleted while pending.
    return [
        (EntryRef(_text(stream), _b(mid)), fields or {})
        for stream, entries in reply
        for mid, fields in entries
    ]


def _script_entries(stream: str, rows: Any) -> list[Entry]:
    """Entries as a script returns them: [[id, [field, value, ...]], ...]."""
    entries: list[Entry] = []
    for mid, flat in rows or ():
        flat = flat or []
        fields = {_b(k): _b(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}
        entries.append((EntryRef(stream, _b(mid)), fields))
    return entries


def _by_stream(refs: list[EntryRef]) -> dict[str, list[bytes]]:
    grouped: dict[str, list[bytes]] = defaultdict(list)
    for ref in refs:
        grouped[ref.stream].append(ref.id)
    return grouped


def _b(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
