"""How a replica lets go of its requests: a drain (nothing new taken, unstarted requests handed back
at once, the running ones given a grace period) and giving up on all of them at the end of a drain
or after an engine failure (all go back to the stream; the replica taking one that streamed
continues it)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.protocol import ErrorCode, Event
from engine.worker.queue import EntryRef

if TYPE_CHECKING:
    from engine.worker.loop import EngineWorker

logger = logging.getLogger("engine.worker")


class Drain:
    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    def give_up_all(self, code: ErrorCode, message: str, *, hand_back: bool) -> None:
        """Give up on every held request: all go back to the stream, where the replica that takes
        one that streamed continues it (a failover); with max_failovers 0, a reader that saw output
        gets an error instead.

        A stopping replica (`hand_back`) re-adds them to the stream, where any replica's next read
        takes them. After an engine failure they are released instead, to the next reclaim, which
        counts their deliveries: one of them may be what broke the engine, and max_deliveries ends a
        request that breaks every replica taking it.
        """
        w = self.worker
        entries: list[EntryRef] = []
        for held in list(w.held.values()):
            # A quiet request's output held back is published first: the replica that continues
            # it resumes from its stream.
            w.events.extend((held.request_id, e) for e in held.release())
            if held.has_streamed and not w.settings.max_failovers:
                w.end(held, Event.error(message, code, held.usage()))
            else:
                entries.append(held.message_id)
            try:
                w.engine.abort_request(held.request_id)
            except Exception:  # the engine is already broken; the process is about to exit
                pass
        w.held.clear()
        w.flush()
        if hand_back:
            w.queue.hand_back(entries)
        else:
            w.queue.release(entries)

    def begin(self) -> float:
        """Say so in the heartbeat at once (the web tier stops counting this replica as ready);
        returns the monotonic time at which the grace period ends."""
        w = self.worker
        logger.info(
            "draining: %d requests held, %.0f s for the running ones",
            len(w.held),
            w.settings.drain_grace_s,
        )
        w.beat()
        return time.monotonic() + w.settings.drain_grace_s

    def hand_back_unstarted(self) -> None:
        """Requests held here that have not started go back to the stream at once, and are aborted
        here. Checked on every iteration of a drain: a sequence preempted before its first token is
        unstarted again. The engine's view is read, never changed: its scheduler's running list."""
        w = self.worker
        # Requests routed here before the web tier saw the drain go to the shared stream.
        w.queue.retire(w.settings.replica_id)
        running = w.engine.running_request_ids()
        unstarted = [h for h in w.held.values() if not h.has_streamed and h.request_id not in running]
        if not unstarted:
            return
        for held in unstarted:
            del w.held[held.request_id]
            # Before the hand-back: it takes effect at this replica's next step, before anything is
            # scheduled, so the request never runs here once another replica can have it.
            w.engine.abort_request(held.request_id)
        handed = w.queue.hand_back([held.message_id for held in unstarted])
        # An entry not handed back was reclaimed from this replica meanwhile: its new holder answers it.
        logger.info("handed back %d unstarted requests", len(handed))
