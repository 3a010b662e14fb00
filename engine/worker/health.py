"""A replica's health port: plain HTTP for an orchestrator's probes (Kubernetes, a load balancer).

`GET /live`: 200 once the model is loaded and while the loop comes round (waiting for Redis
counts: a restart would not bring Redis back); 503 while the model loads, so the same path serves
as the startup probe, and once the loop has not come round for heartbeat.STALL_LIMIT_S (a
wedged process, to be restarted).

`GET /ready`: 200 only while the replica takes work: loaded and warmed, its first heartbeat
published, Redis reachable, not draining. 503 otherwise, with the reason. A replica's readiness
does not route anything (requests reach it through Redis, not through a Service); it tells a
rollout when a new replica serves, and an operator which ones do not.

The answers are JSON: `{"status": ..., "model": ..., "replica": ...}`. The server runs in a daemon
thread and reads the loop's state without locks: each answer is a snapshot of a few attributes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from engine.worker.heartbeat import STALL_LIMIT_S

if TYPE_CHECKING:
    from engine.worker.loop import EngineWorker

logger = logging.getLogger("engine.worker")

LIVE_PATH = "/live"
READY_PATH = "/ready"


class Health:
    """What the probes read: the worker once the model is loaded, None before."""

    def __init__(self, *, model: str, replica_id: str) -> None:
        self.model, self.replica_id = model, replica_id
        self.worker: EngineWorker | None = None

    def live(self) -> tuple[bool, str]:
        worker = self.worker
        if worker is None:
            return False, "starting"
        if time.monotonic() - worker.heartbeat.progress_at > STALL_LIMIT_S:
            return False, "stalled"
        return True, "draining" if worker.stopping else "live"

    def ready(self) -> tuple[bool, str]:
        live, status = self.live()
        worker = self.worker
        if not live or worker is None:
            return False, status
        if worker.stopping:
            return False, "draining"
        if not worker.redis_reachable:
            return False, "redis_unreachable"
        if not worker.serving:
            return False, "starting"
        return True, "ready"


class _Handler(BaseHTTPRequestHandler):
    server: _HealthHTTPServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        health = self.server.health
        if path == LIVE_PATH:
            ok, status = health.live()
        elif path == READY_PATH:
            ok, status = health.ready()
        else:
            self._answer(404, {"status": "not_found", "paths": [LIVE_PATH, READY_PATH]})
            return
        self._answer(
            200 if ok else 503, {"status": status, "model": health.model, "replica": health.replica_id}
        )

    def _answer(self, code: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # probes every few seconds: not worth a log line each


class _HealthHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], health: Health) -> None:
        super().__init__(address, _Handler)
        self.health = health


class HealthServer:
    """The health port, served from a daemon thread from `start` until `stop`."""

    def __init__(self, health: Health, *, host: str, port: int) -> None:
        self.health = health
        self._server = _HealthHTTPServer((host, port), health)
        self._thread = threading.Thread(target=self._server.serve_forever, name="health", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()
        logger.info(
            "health port %s:%d (%s, %s)", self._server.server_address[0], self.port, LIVE_PATH, READY_PATH
        )

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
