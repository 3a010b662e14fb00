"""The Redis loop of one engine replica: see engine.worker.loop; `python -m engine serve` starts it."""

from __future__ import annotations

from engine.worker.loop import EXIT_ENGINE_FAILED, EXIT_OK, EngineWorker
from engine.worker.queue import RequestQueue
from engine.worker.settings import WorkerSettings, default_replica_id

__all__ = [
    "EXIT_ENGINE_FAILED",
    "EXIT_OK",
    "EngineWorker",
    "RequestQueue",
    "WorkerSettings",
    "default_replica_id",
]
