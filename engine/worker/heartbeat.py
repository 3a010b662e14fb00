"""A replica's heartbeat: its stats published to Redis by the worker's loop every interval, and
kept fresh by a thread of its own while one step outlasts the heartbeat's TTL (a big prefill on a
busy CPU takes seconds), so such a replica is not taken for dead. A loop stalled past
STALL_LIMIT_S gets no beats and expires as a dead one would."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from engine.protocol import ReplicaStats
from engine.worker.queue import CONNECTION_ERRORS, RequestQueue
from engine.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.embedding_engine import EmbeddingEngine
    from engine.llm_engine import LLMEngine

logger = logging.getLogger("engine.worker")

# A loop that has not come round for this long is wedged: the heartbeat thread stops beating.
STALL_LIMIT_S = 120.0


class Heartbeat:
    def __init__(
        self, engine: LLMEngine | EmbeddingEngine, queue: RequestQueue, settings: WorkerSettings
    ) -> None:
        self.engine, self.queue, self.settings = engine, queue, settings
        self.started_at = time.time()
        self._last_stats: ReplicaStats | None = None
        self._last_beat = 0.0  # monotonic
        self.progress_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self) -> None:
        """The loop came round: the thread may keep beating for it."""
        self.progress_at = time.monotonic()

    def stats(self, *, draining: bool) -> ReplicaStats:
        load = self.engine.load()
        return ReplicaStats(
            replica_id=self.settings.replica_id,
            model=self.settings.model,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_cache_usage,
            prefix_cache_hit_rate=load.prefix_cache_hit_rate,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            loras_loaded=list(load.loras_loaded),
            num_resumed_requests=load.num_resumed_requests,
            num_resumed_tokens=load.num_resumed_tokens,
            spec_num_draft_tokens=load.spec_num_draft_tokens,
            spec_num_accepted_tokens=load.spec_num_accepted_tokens,
            num_routed_requests=self.queue.num_routed,
            num_stolen_requests=self.queue.num_stolen,
            num_interrupted_steps=load.num_interrupted_steps,
            started_at=self.started_at,
            heartbeat_at=time.time(),
            draining=draining,
        )

    def beat(self, *, draining: bool) -> None:
        """Publishes the replica's stats now (from the loop; Redis's errors are the caller's)."""
        stats = self.stats(draining=draining)
        self.queue.heartbeat(stats)
        self._last_stats, self._last_beat = stats, time.monotonic()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat_between_steps, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def remove(self) -> None:
        """The replica leaves: its heartbeat and its consumer go at once (Redis's errors logged)."""
        try:
            self.queue.remove_heartbeat()
            self.queue.leave_group()
        except CONNECTION_ERRORS:  # Redis is gone too; the heartbeat TTL expires on its own
            logger.warning("could not remove the heartbeat: Redis is unreachable")
        except Exception:
            logger.exception("could not remove the heartbeat")

    def _beat_between_steps(self) -> None:
        """Re-publishes the loop's latest stats when the loop has not beaten for an interval."""
        interval = self.settings.heartbeat_interval_s
        while not self._stop.wait(interval):
            now = time.monotonic()
            stats = self._last_stats
            if stats is None or now - self._last_beat < interval or now - self.progress_at > STALL_LIMIT_S:
                continue
            try:
                self.queue.heartbeat(dataclasses.replace(stats, heartbeat_at=time.time()))
            except CONNECTION_ERRORS:  # Redis unreachable: the loop's own calls report it, once
                pass
            except Exception:
                logger.warning("heartbeat failed", exc_info=True)
