"""One engine replica's loop: take requests from its model's stream, step the engine, stream events back.

Per iteration: (re)claim requests, take new ones (a bounded blocking read only when the engine is
idle), apply cancels, one engine step, then one pipeline with every event of the step and the acks
of the requests that ended. Delivery is at-least-once; what keeps a reader from seeing an answer
twice is that a request taken over from another replica (reclaimed from a dead one, or handed back)
which had already streamed is never run again from its start: it is continued from what its output
stream shows, after a failover marker that fences out anything the lost replica still writes
(engine.resume, RequestQueue.take_over). A replica whose heartbeat lapsed has its requests taken
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
import time
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput
from engine.protocol import ErrorCode, Event, GenerateRequest, ProtocolError, ReplicaStats
from engine.worker.heartbeat import Heartbeat
from engine.worker.intake import Takeover, add_to_engine, request_id_of, take_over
from engine.worker.outputs import HeldRequest, events_for_output
from engine.worker.queue import CONNECTION_ERRORS, RequestQueue
from engine.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger("engine.worker")

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1
# Longest wait between two tries to reach Redis again.
REDIS_RETRY_MAX_S = 2.0


class EngineWorker:
    def __init__(self, engine: LLMEngine, queue: RequestQueue, settings: WorkerSettings) -> None:
        self.engine = engine
        self.queue = queue
        self.settings = settings
        self.max_held = settings.max_held or 256
        self._held: dict[str, HeldRequest] = {}
        self._cancelled: dict[str, float] = {}  # cancels of requests not (yet) held here -> when seen
        self._events: list[tuple[str, Event]] = []
        self._acks: list[bytes] = []
        self._stopping = False
        self._force_stop = False
        self.heartbeat = Heartbeat(engine, queue, settings)

    # --- control --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """First call: drain (take nothing new, hand back what has not started, finish what runs
        within the grace period). Second call: stop now."""
        if self._stopping:
            self._force_stop = True
        self._stopping = True

    def run(self) -> int:
        while True:
            try:
                self.queue.ensure_group()
                self.queue.start_cancels(self.settings.cancel_lookback_s)
                for message_id, fields, deliveries in self.queue.read_own_pending(self.max_held):
                    self._take(message_id, fields, reclaimed=True, deliveries=deliveries)
                self._flush()
                self._heartbeat()
                break
            except CONNECTION_ERRORS as exc:
                if not self._wait_for_redis(exc):
                    return EXIT_OK
        self.heartbeat.start()
        now = time.monotonic()
        self._next_touch = now + self.settings.touch_interval_s
        self._next_reclaim = now
        self._next_orphan_check = now
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
            try:
                self._flush()
            except CONNECTION_ERRORS:
                logger.warning("stopping with %d events Redis did not take", self.queue.num_unsent)
            self.heartbeat.remove()

    def _iterate(self) -> int | None:
        """One turn of the loop; the exit status when the replica is done."""
        self.heartbeat.progress()
        if self._force_stop:
            self._fail_all(ErrorCode.ENGINE_SHUTDOWN, "the engine replica was stopped", hand_back=True)
            return EXIT_OK
        if self._stopping:
            if self._drain_deadline is None:
                self._drain_deadline = self._begin_drain()
            self._hand_back_unstarted()
            if not self._held:
                return EXIT_OK
            if time.monotonic() >= self._drain_deadline:
                logger.warning("drain grace period over with %d requests running; stopping", len(self._held))
                message = "the engine replica shut down before this request finished"
                self._fail_all(ErrorCode.ENGINE_SHUTDOWN, message, hand_back=True)
                return EXIT_OK
        now = time.monotonic()
        if not self._stopping and now >= self._next_reclaim:
            self._reclaim()
            self._next_reclaim = now + self.settings.reclaim_interval_s
        if not self._stopping and now >= self._next_orphan_check:
            self._claim_orphans()
            self._next_orphan_check = now + self.settings.heartbeat_interval_s
        if not self._stopping:
            self._read_requests(block=not self.engine.has_unfinished_requests())
        # After the reads: a request cancelled while this replica blocked on the stream is
        # aborted before its first step.
        self._apply_cancels()
        if self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except Exception:
                logger.exception("engine step failed; failing the requests in flight")
                message = "the engine failed while running this request"
                self._fail_all(ErrorCode.ENGINE_ERROR, message, hand_back=False)
                return EXIT_ENGINE_FAILED
            self._collect(outputs)
        elif self._stopping:
            # Draining with an idle engine: the read above did not block, so wait briefly
            # instead of spinning on the cancel stream.
            time.sleep(0.01)
        self._flush()
        now = time.monotonic()
        if now >= self._next_touch:
            self._touch()
            # Answered requests leave the stream once their output stream would have.
            self.queue.trim_answered(self.settings.output_ttl_s)
            self._next_touch = now + self.settings.touch_interval_s
        if now >= self._next_heartbeat:
            self._heartbeat()
            self._next_heartbeat = now + self.settings.heartbeat_interval_s
        return None

    def _wait_for_redis(self, exc: Exception) -> bool:
        """Wait, with backoff, until Redis answers again; False when the replica is to stop instead
        (a second stop request, or a drain whose grace period ran out while waiting)."""
        lost_at = time.monotonic()
        logger.warning(
            "lost the connection to Redis (%s: %s); holding %d requests and retrying",
            exc.__class__.__name__,
            exc,
            len(self._held),
        )
        delay = 0.05
        while not self._force_stop:
            if self._stopping and time.monotonic() - lost_at > self.settings.drain_grace_s:
                logger.warning("stopping without Redis: %d requests were not answered", len(self._held))
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
            return True
        return False

    # --- taking requests ------------------------------------------------------------------------

    def _read_requests(self, *, block: bool) -> None:
        room = self.max_held - len(self._held)
        if room <= 0:
            return
        entries = self.queue.read_new(room, self.settings.idle_block_ms if block else None)
        for message_id, fields in entries:
            self._take(message_id, fields)

    def _reclaim(self) -> None:
        room = self.max_held - len(self._held)
        if room <= 0:
            return
        for message_id, fields, deliveries in self.queue.autoclaim(self.settings.claim_timeout_ms, room):
            logger.info("reclaimed request entry %s (delivery %d)", message_id, deliveries)
            self._take(message_id, fields, reclaimed=True, deliveries=deliveries)

    def _claim_orphans(self) -> None:
        room = self.max_held - len(self._held)
        if room <= 0:
            return
        for message_id, fields, deliveries in self.queue.claim_orphans(room):
            logger.info(
                "took over request entry %s from a lost replica (delivery %d)", message_id, deliveries
            )
            self._take(message_id, fields, reclaimed=True, deliveries=deliveries)

    def _take(self, message_id: bytes, fields: dict, *, reclaimed: bool = False, deliveries: int = 1) -> None:
        try:
            request = GenerateRequest.decode(fields)
        except ProtocolError as exc:
            request_id = request_id_of(fields)
            logger.warning("malformed request entry %s (request %r): %s", message_id, request_id, exc)
            if request_id:
                self._events.append((request_id, Event.error(str(exc), ErrorCode.INVALID_REQUEST)))
            self._acks.append(message_id)
            return
        held = self._held.get(request.request_id)
        if held is not None:
            # A second delivery of a request already running here (its entry was re-added), or the
            # same entry read again after a read whose answer was lost with the connection.
            if held.message_id != message_id:
                self._acks.append(message_id)
            return
        resume = None
        # An entry that another replica held (reclaimed, or handed back by a stopping one) may have
        # streamed: its output stream says whether it is settled, or continues from where it was.
        if reclaimed or b"handed" in fields or "handed" in fields:
            takeover = self._take_over(request, message_id, deliveries)
            if takeover.settled:
                return
            resume = takeover.resume
        held = HeldRequest(
            request_id=request.request_id,
            message_id=message_id,
            n=int(request.sampling_params.get("n", 1)) if isinstance(request.sampling_params, dict) else 1,
            num_prompt_tokens=len(request.prompt_token_ids),
        )
        if resume is not None:
            held.completion_tokens = [len(tokens) for tokens in resume.outputs]
            held.replica_marked = True  # by the failover marker
        if self._cancelled.pop(request.request_id, None) is not None:
            self._end(held, held.aborted_event())
            return
        error = add_to_engine(self.engine, request, resume)
        if error is not None:
            self._end(held, error)
            return
        self._held[request.request_id] = held

    def _take_over(self, request: GenerateRequest, message_id: bytes, deliveries: int) -> Takeover:
        try:
            seen, _ = self.queue.take_over(request.request_id)
        except ProtocolError:
            seen = [Event(type="error")]  # unreadable output: never stream a second answer into it
        takeover = take_over(request, seen, deliveries, self.settings)
        if takeover.event is not None:
            self._events.append((request.request_id, takeover.event))
        if takeover.settled:
            self._acks.append(message_id)
        elif takeover.resume is not None:
            logger.info(
                "continuing request %s after %d tokens (failover %d)",
                request.request_id,
                takeover.resume.num_tokens,
                takeover.resume.failovers,
            )
        return takeover

    # --- cancels, outputs -----------------------------------------------------------------------

    def _apply_cancels(self) -> None:
        now = time.monotonic()
        for request_id in self.queue.read_cancels():
            held = self._held.pop(request_id, None)
            if held is None:
                self._cancelled[request_id] = now
                continue
            self.engine.abort_request(request_id)
            self._end(held, held.aborted_event(), already_popped=True)
        horizon = now - self.settings.cancel_lookback_s
        for request_id in [r for r, t in self._cancelled.items() if t < horizon]:
            del self._cancelled[request_id]

    def _collect(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            held = self._held.get(output.request_id)
            if held is None:
                continue  # aborted or lost this step; its end was already written or is not ours
            events = events_for_output(held, output)
            if not held.replica_marked and events and events[0].type == "delta":
                # The reader learns which replica holds its request from the first delta (or from
                # a failover marker), so it can tell when that replica's heartbeat stops (not on
                # every token: bytes).
                events[0].replica = self.settings.replica_id
                held.replica_marked = True
            self._events.extend((held.request_id, e) for e in events)
            if events and events[-1].type in ("finished", "error"):
                del self._held[held.request_id]
                self._acks.append(held.message_id)

    def _end(self, held: HeldRequest, event: Event, *, already_popped: bool = False) -> None:
        if not already_popped:
            self._held.pop(held.request_id, None)
        self._events.append((held.request_id, event))
        self._acks.append(held.message_id)

    def _flush(self) -> None:
        events, acks = self._events, self._acks
        self._events, self._acks = [], []
        for _, event in events:
            if event.type != "delta":  # which replica answered, for logs and tests; not on every token
                event.replica = self.settings.replica_id
        self.queue.publish(events, acks)

    def _fail_all(self, code: ErrorCode, message: str, *, hand_back: bool) -> None:
        """Give up on every held request: all go back to the stream, where the replica that takes
        one that streamed continues it (a failover); with max_failovers 0, a reader that saw output
        gets an error instead.

        A stopping replica (`hand_back`) re-adds them to the stream, where any replica's next read
        takes them. After an engine failure they are released instead, to the next reclaim, which
        counts their deliveries: one of them may be what broke the engine, and max_deliveries ends a
        request that breaks every replica taking it.
        """
        unstarted: list[bytes] = []
        for held in list(self._held.values()):
            if held.has_streamed and not self.settings.max_failovers:
                self._end(held, Event.error(message, code, held.usage()))
            else:
                unstarted.append(held.message_id)
            try:
                self.engine.abort_request(held.request_id)
            except Exception:  # the engine is already broken; the process is about to exit
                pass
        self._held.clear()
        self._flush()
        if hand_back:
            self.queue.hand_back(unstarted)
        else:
            self.queue.release(unstarted)

    # --- draining -------------------------------------------------------------------------------

    def _begin_drain(self) -> float:
        """Say so in the heartbeat at once (the web tier stops counting this replica as ready);
        returns the monotonic time at which the grace period ends."""
        logger.info(
            "draining: %d requests held, %.0f s for the running ones",
            len(self._held),
            self.settings.drain_grace_s,
        )
        self._heartbeat()
        return time.monotonic() + self.settings.drain_grace_s

    def _hand_back_unstarted(self) -> None:
        """Requests held here that have not started go back to the stream at once, and are aborted
        here. Checked on every iteration of a drain: a sequence preempted before its first token is
        unstarted again. The engine's view is read, never changed: its scheduler's running list."""
        running = {seq.request_id for seq in self.engine.scheduler.running}
        unstarted = [h for h in self._held.values() if not h.has_streamed and h.request_id not in running]
        if not unstarted:
            return
        for held in unstarted:
            del self._held[held.request_id]
            # Before the hand-back: it takes effect at this replica's next step, before anything is
            # scheduled, so the request never runs here once another replica can have it.
            self.engine.abort_request(held.request_id)
        handed = self.queue.hand_back([held.message_id for held in unstarted])
        # An entry not handed back was reclaimed from this replica meanwhile: its new holder answers it.
        logger.info("handed back %d unstarted requests", len(handed))

    # --- liveness -------------------------------------------------------------------------------

    def _touch(self) -> None:
        by_message = {held.message_id: held for held in self._held.values()}
        owned = self.queue.touch(list(by_message))
        for message_id, held in by_message.items():
            if message_id not in owned:
                # Another replica reclaimed it while this one stalled; it answers it now.
                logger.warning("request %s was reclaimed by another replica; dropping it", held.request_id)
                self._held.pop(held.request_id, None)
                self.engine.abort_request(held.request_id)

    def stats(self) -> ReplicaStats:
        return self.heartbeat.stats(draining=self._stopping)

    def _heartbeat(self) -> None:
        self.heartbeat.beat(draining=self._stopping)
