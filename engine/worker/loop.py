"""One engine replica's loop: take requests from its model's stream, step the engine, stream events back.

Per iteration: (re)claim requests, take new ones (a bounded blocking read only when the engine is
idle), apply cancels, one engine step, then one pipeline with every event of the step and the acks
of the requests that ended. While requests still run, that pipeline also reads the new requests
and cancels for the next step: one round trip between two steps. Delivery is at-least-once; what
keeps a reader from seeing an answer twice is that a request taken over from another replica
(reclaimed from a dead one, or handed back) which had already streamed is never run again from its
start: it is continued from what its output stream shows, after a failover marker that fences out
anything the lost replica still writes (engine.resume, RequestQueue.take_over). A replica whose heartbeat lapsed has its requests taken
over at once; one that only stopped touching them, after the claim timeout.

Redis unreachable (restarting, a blip, an outage): the loop stops stepping, keeps every request
it holds with its sequences and unsent events, and retries with backoff, logging once when the
connection is lost and once when it is back; then it carries on where it was (its stream cursors,
its unsent events, which are written exactly once). It does not exit.

Draining (the first stop request): nothing new is taken; requests held here that have not started
(nothing streamed, no sequence running in the engine) go back to the stream at once for another
replica; the running ones get `drain_grace_s` to finish, after which the replica stops as at a
second stop request: every request it holds is handed back, and the replica taking one that
streamed continues it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from engine.protocol import ErrorCode, Event, ReplicaStats
from engine.worker.arrivals import ArrivalWatch
from engine.worker.drain import Drain
from engine.worker.heartbeat import Heartbeat
from engine.worker.intake import Intake
from engine.worker.outputs import HeldRequest, events_for_output
from engine.worker.queue import CONNECTION_ERRORS, EntryRef, RequestQueue
from engine.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.embedding_engine import EmbeddingEngine
    from engine.llm_engine import LLMEngine

logger = logging.getLogger("engine.worker")

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1
# Longest wait between two tries to reach Redis again.
REDIS_RETRY_MAX_S = 2.0


class EngineWorker:
    def __init__(
        self, engine: LLMEngine | EmbeddingEngine, queue: RequestQueue, settings: WorkerSettings
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.settings = settings
        self.max_held = settings.max_held or 256
        self.held: dict[str, HeldRequest] = {}
        self.cancelled: dict[str, float] = {}  # cancels of requests not (yet) held here -> when seen
        self.events: list[tuple[str, Event]] = []
        self.acks: list[EntryRef] = []
        # Whether the last flush read the new requests and cancels for this turn of the loop.
        self._read_ahead = False
        self._stopping = False
        self._force_stop = False
        # For the health port (engine.worker.health): taking work since the first heartbeat, and
        # whether Redis answered the last call.
        self.serving = False
        self.redis_reachable = True
        self.heartbeat = Heartbeat(engine, queue, settings)
        self.intake = Intake(self)
        self.drain = Drain(self)
        # Set when a request more important than the spare-capacity tier reaches this replica's
        # streams; its engine gives up a spare-capacity step then (engine.step_interrupt).
        self.arrived: threading.Event | None = None
        self.watch: ArrivalWatch | None = None
        from engine.llm_engine import LLMEngine as Generating

        if settings.step_interrupts and isinstance(engine, Generating):
            self.arrived = engine.enable_step_interrupts()

    # --- control --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """First call: drain (take nothing new, hand back what has not started, finish what runs
        within the grace period). Second call: stop now."""
        if self._stopping:
            self._force_stop = True
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def run(self) -> int:
        while True:
            try:
                self.queue.ensure_group()
                self.queue.start_cancels(self.settings.cancel_lookback_s)
                for message_id, fields, deliveries in self.queue.read_own_pending(self.max_held):
                    self.intake.take(message_id, fields, reclaimed=True, deliveries=deliveries)
                self.flush()
                self.beat()
                break
            except CONNECTION_ERRORS as exc:
                if not self._wait_for_redis(exc):
                    return EXIT_OK
        self.serving = True
        self.heartbeat.start()
        if self.arrived is not None:
            streams = [self.queue.own_stream, self.queue.stream]
            self.watch = ArrivalWatch(self.queue.client, streams, self.arrived).start()
        now = time.monotonic()
        self._next_touch = now + self.settings.touch_interval_s
        self._next_reclaim = now
        self._next_orphan_check = now
        self._next_steal = now
        self._next_heartbeat = now + self.settings.heartbeat_interval_s
        self._drain_deadline: float | None = None
        try:
            while True:
                try:
                    status = self._iterate()
                except CONNECTION_ERRORS as exc:
                    if not self._wait_for_redis(exc):
                        return EXIT_OK
                    # Its requests idled in Redis while it was away: touch them at once, and leave
                    # the others' to them for a claim timeout before reclaiming any.
                    now = time.monotonic()
                    self._next_touch = now
                    self._next_reclaim = now + self.settings.claim_timeout_ms / 1000
                    continue
                if status is not None:
                    return status
        finally:
            self.heartbeat.stop()
            if self.watch is not None:
                self.watch.stop()
            try:
                self.flush()
            except CONNECTION_ERRORS:
                logger.warning("stopping with %d events Redis did not take", self.queue.num_unsent)
            self.heartbeat.remove()

    def _iterate(self) -> int | None:
        """One turn of the loop; the exit status when the replica is done."""
        self.heartbeat.progress()
        if self._force_stop:
            self.drain.give_up_all(
                ErrorCode.ENGINE_SHUTDOWN, "the engine replica was stopped", hand_back=True
            )
            return EXIT_OK
        if self._stopping:
            if self._drain_deadline is None:
                self._drain_deadline = self.drain.begin()
            self.drain.hand_back_unstarted()
            if not self.held:
                return EXIT_OK
            if time.monotonic() >= self._drain_deadline:
                logger.warning("drain grace period over with %d requests running; stopping", len(self.held))
                message = "the engine replica shut down before this request finished"
                self.drain.give_up_all(ErrorCode.ENGINE_SHUTDOWN, message, hand_back=True)
                return EXIT_OK
        now = time.monotonic()
        if not self._stopping and now >= self._next_reclaim:
            self.intake.reclaim()
            self._next_reclaim = now + self.settings.reclaim_interval_s
        if not self._stopping and now >= self._next_orphan_check:
            self.intake.claim_orphans()
            self._next_orphan_check = now + self.settings.heartbeat_interval_s
        # The last flush may have read ahead, in its round trip, what this turn reads (see flush).
        read_ahead, self._read_ahead = self._read_ahead, False
        if self.arrived is not None and not read_ahead:
            # What arrives from here on is read before the next step; a draining replica reads
            # nothing new, so an arrival gives up at most the one step it came during.
            self.arrived.clear()
        cancels = None
        if not self._stopping:
            if not read_ahead:
                # The cancels come in the read's round trips, read after it returned.
                cancels = self.intake.read_new(block=not self.engine.has_unfinished_requests())
            if now >= self._next_steal:
                self.intake.steal()
                self._next_steal = now + self.settings.steal_interval_s
        if not read_ahead:
            # After the reads: a request cancelled while this replica blocked on the stream is
            # aborted before its first step.
            self._apply_cancels(cancels)
        if self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except Exception:
                logger.exception("engine step failed; failing the requests in flight")
                message = "the engine failed while running this request"
                self.drain.give_up_all(ErrorCode.ENGINE_ERROR, message, hand_back=False)
                return EXIT_ENGINE_FAILED
            self._collect(outputs)
        elif self._stopping:
            # Draining with an idle engine: the read above did not block, so wait briefly
            # instead of spinning on the cancel stream.
            time.sleep(0.01)
        # When another step follows at once, its reads go with this step's events.
        self.flush(read_ahead=not self._stopping and self.engine.has_unfinished_requests())
        now = time.monotonic()
        if now >= self._next_touch:
            self._touch()
            # Answered requests leave the stream once their output stream would have.
            self.queue.trim_answered(self.settings.output_ttl_s)
            self._next_touch = now + self.settings.touch_interval_s
        if now >= self._next_heartbeat:
            self.beat()
            self._next_heartbeat = now + self.settings.heartbeat_interval_s
        return None

    def _wait_for_redis(self, exc: Exception) -> bool:
        """Wait, with backoff, until Redis answers again; False when the replica is to stop instead
        (a second stop request, or a drain whose grace period ran out while waiting)."""
        lost_at = time.monotonic()
        self.redis_reachable = False
        logger.warning(
            "lost the connection to Redis (%s: %s); holding %d requests and retrying",
            exc.__class__.__name__,
            exc,
            len(self.held),
        )
        delay = 0.05
        while not self._force_stop:
            if self._stopping and time.monotonic() - lost_at > self.settings.drain_grace_s:
                logger.warning("stopping without Redis: %d requests were not answered", len(self.held))
                return False
            time.sleep(delay)
            delay = min(2 * delay, REDIS_RETRY_MAX_S)
            self.heartbeat.progress()
            try:
                self.queue.client.ping()
                # A Redis that lost its data (no persistence) lost the consumer group too.
                self.queue.ensure_group()
            except CONNECTION_ERRORS:
                continue
            logger.warning("Redis answers again after %.1f s; resuming", time.monotonic() - lost_at)
            self.redis_reachable = True
            return True
        return False

    # --- cancels, outputs -----------------------------------------------------------------------

    def _apply_cancels(self, request_ids: list[str] | None = None) -> None:
        """Abort the requests cancelled since the last read (`request_ids`: read already)."""
        now = time.monotonic()
        for request_id in self.queue.read_cancels() if request_ids is None else request_ids:
            held = self.held.pop(request_id, None)
            if held is None:
                self.cancelled[request_id] = now
                continue
            self.engine.abort_request(request_id)
            self.end(held, held.aborted_event(), already_popped=True)
        horizon = now - self.settings.cancel_lookback_s
        for request_id in [r for r, t in self.cancelled.items() if t < horizon]:
            del self.cancelled[request_id]

    def _collect(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            held = self.held.get(output.request_id)
            if held is None:
                continue  # aborted or lost this step; its end was already written or is not ours
            streamed_before = held.has_streamed
            events = events_for_output(held, output)
            if held.quiet and streamed_before and self.settings.quiet_publish_s > 0:
                # Its reader answers with the whole text: what follows its first tokens goes at
                # its end, or once quiet_publish_s has passed (HeldRequest.to_publish).
                events = held.to_publish(events, time.monotonic(), self.settings.quiet_publish_s)
            if not held.replica_marked and events and events[0].type == "delta":
                # The reader learns which replica holds its request from the first delta (or from
                # a failover marker), so it can tell when that replica's heartbeat stops (not on
                # every token: bytes).
                events[0].replica = self.settings.replica_id
                held.replica_marked = True
            self.events.extend((held.request_id, e) for e in events)
            if events and events[-1].type in ("finished", "error"):
                del self.held[held.request_id]
                self.acks.append(held.message_id)

    def end(self, held: HeldRequest, event: Event, *, already_popped: bool = False) -> None:
        if not already_popped:
            self.held.pop(held.request_id, None)
        self.events.extend((held.request_id, e) for e in held.release())
        self.events.append((held.request_id, event))
        self.acks.append(held.message_id)

    def flush(self, *, read_ahead: bool = False) -> None:
        """Publish the events and acks gathered; with `read_ahead`, the same round trip reads the
        new requests and cancels that the next turn of the loop would read (RequestQueue.publish),
        and they are taken and applied here."""
        events, acks = self.events, self.acks
        self.events, self.acks = [], []
        for _, event in events:
            if event.type != "delta":  # which replica answered, for logs and tests; not on every token
                event.replica = self.settings.replica_id
        room = self.max_held - len(self.held)
        if not read_ahead or room <= 0:
            self.queue.publish(events, acks)
            return
        if self.arrived is not None:
            self.arrived.clear()  # as the next turn would before its read (see _iterate)
        ahead = self.queue.publish(events, acks, read_ahead=room)
        assert ahead is not None
        # Taken and applied here, as the next turn would: a drain that begins then hands back
        # what was read as it hands back any request that has not started.
        if ahead.entries is not None:
            self.intake.take_new(ahead.entries)
        self._apply_cancels(ahead.cancels)
        self._read_ahead = ahead.entries is not None
        if self.events or self.acks:
            # Requests that ended here (cancelled, or refused as they were taken): their ends and
            # acks go now, as the next turn's would have before it steps. An entry left unacked
            # and untouched would be reclaimed as a lost one.
            self.flush()

    # --- liveness -------------------------------------------------------------------------------

    def _touch(self) -> None:
        by_message = {held.message_id: held for held in self.held.values()}
        owned = self.queue.touch(list(by_message))
        for message_id, held in by_message.items():
            if message_id not in owned:
                # Another replica reclaimed it while this one stalled; it answers it now.
                logger.warning("request %s was reclaimed by another replica; dropping it", held.request_id)
                self.held.pop(held.request_id, None)
                self.engine.abort_request(held.request_id)

    def stats(self) -> ReplicaStats:
        return self.heartbeat.stats(draining=self._stopping)

    def beat(self) -> None:
        self.heartbeat.beat(draining=self._stopping)
