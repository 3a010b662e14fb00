"""The engine replica's health port (engine.worker.health): what Kubernetes' probes read.

A worker in a thread with a gated engine step shows the states a probe must tell apart (draining,
stalled) at a moment the test chooses; engine processes show the port as a deployment runs it.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from engine.worker.health import Health, HealthServer
from tests.e2e.processes import free_port
from tests.engine.test_worker import (
    MODEL,
    REDIS_URL,
    Workers,
    events_of,
    new_prefix,
    submit,
    tiny_engine,
    wait_for,
)

pytestmark = pytest.mark.slow


def probe(port: int, path: str) -> tuple[int, dict] | None:
    """(status, body) of GET path on the health port; None while nothing listens there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (ConnectionError, urllib.error.URLError):
        return None


def wait_for_probe(port: int, path: str, status: str, what: str, timeout: float = 120.0) -> tuple[int, dict]:
    found: list[tuple[int, dict]] = []

    def answered() -> bool:
        answer = probe(port, path)
        if answer is not None and answer[1]["status"] == status:
            found.append(answer)
            return True
        return False

    wait_for(answered, timeout, what)
    return found[0]


@pytest.fixture
def gated_worker(tiny_llama_dir: Path) -> Iterator[tuple]:
    """A worker in a thread whose engine steps wait while `gate` is cleared (`in_step` tells that one
    waits); its health port on a free port. Yields (worker, client, prefix, port, gate, in_step)."""
    from engine.worker import EngineWorker, RequestQueue, WorkerSettings

    engine = tiny_engine(tiny_llama_dir)
    real_step, gate, in_step = engine.step, threading.Event(), threading.Event()
    gate.set()

    def gated_step():
        if not gate.is_set():
            in_step.set()
            gate.wait()
            in_step.clear()
        return real_step()

    engine.step = gated_step
    client = redis.Redis.from_url(REDIS_URL)
    prefix = new_prefix()
    settings = WorkerSettings(
        model=MODEL, prefix=prefix, replica_id="gated", heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0
    )
    queue = RequestQueue(
        client, prefix=prefix, model=MODEL, replica_id="gated", output_ttl_s=60, heartbeat_ttl_s=2.0
    )
    health = Health(model=MODEL, replica_id="gated")
    server = HealthServer(health, host="127.0.0.1", port=free_port())
    server.start()
    worker = EngineWorker(engine, queue, settings)
    health.worker = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker, client, prefix, server.port, gate, in_step
    finally:
        gate.set()
        worker.request_stop()
        worker.request_stop()
        thread.join(timeout=30)
        server.stop()
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
        client.close()


def test_a_port_whose_model_is_still_loading_answers_starting_on_both_paths():
    health = Health(model=MODEL, replica_id="loading")
    server = HealthServer(health, host="127.0.0.1", port=free_port())
    server.start()
    try:
        assert probe(server.port, "/live") == (
            503,
            {"status": "starting", "model": MODEL, "replica": "loading"},
        )
        assert probe(server.port, "/ready") == (
            503,
            {"status": "starting", "model": MODEL, "replica": "loading"},
        )
        assert probe(server.port, "/metrics") == (404, {"status": "not_found", "paths": ["/live", "/ready"]})
    finally:
        server.stop()


def test_a_draining_replica_is_live_but_not_ready(gated_worker):
    worker, client, prefix, port, gate, in_step = gated_worker
    assert wait_for_probe(port, "/ready", "ready", "the replica to be ready")[0] == 200
    gate.clear()
    submit(client, prefix, "long", max_tokens=40, ignore_eos=True)
    wait_for(in_step.is_set, 30, "the request's first step to wait at the gate")

    worker.request_stop()

    assert probe(port, "/ready") == (503, {"status": "draining", "model": MODEL, "replica": "gated"})
    assert probe(port, "/live") == (200, {"status": "draining", "model": MODEL, "replica": "gated"})
    gate.set()
    wait_for(
        lambda: [e.type for e in events_of(client, prefix, "long")][-1:] == ["finished"],
        60,
        "the drain to finish the request",
    )


def test_a_loop_stalled_past_the_stall_limit_fails_both_probes(gated_worker, monkeypatch):
    import engine.worker.health as health_module

    worker, client, prefix, port, gate, in_step = gated_worker
    wait_for_probe(port, "/live", "live", "the replica to be live")
    monkeypatch.setattr(health_module, "STALL_LIMIT_S", 0.3)
    gate.clear()
    submit(client, prefix, "stuck", max_tokens=40, ignore_eos=True)
    wait_for(in_step.is_set, 30, "the request's first step to wait at the gate")

    live = wait_for_probe(port, "/live", "stalled", "the stall to show", timeout=30)
    ready = probe(port, "/ready")

    assert live[0] == 503 and ready == (503, {"status": "stalled", "model": MODEL, "replica": "gated"})
    gate.set()
    assert wait_for_probe(port, "/live", "live", "the loop to come round again", timeout=30)[0] == 200


def test_an_engine_process_serves_its_probes_and_closes_the_port_when_it_stops(tiny_llama_dir, tmp_path):
    workers = Workers(tiny_llama_dir, new_prefix(), tmp_path)
    port = free_port()
    try:
        proc = workers.start("probed", "--health-port", str(port), "--health-host", "127.0.0.1")

        ready = wait_for_probe(port, "/ready", "ready", "the replica to be ready")
        live = probe(port, "/live")

        assert ready == (200, {"status": "ready", "model": MODEL, "replica": "probed"})
        assert live == (200, {"status": "live", "model": MODEL, "replica": "probed"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, workers.log("probed")
        assert probe(port, "/live") is None
    finally:
        workers.close()


def test_an_engine_process_without_redis_is_live_but_not_ready(tiny_llama_dir, tmp_path):
    workers = Workers(tiny_llama_dir, new_prefix(), tmp_path)
    port = free_port()
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    try:
        proc = workers.start(
            "lonely", "--redis-url", nowhere, "--health-port", str(port), "--health-host", "127.0.0.1",
            "--drain-grace-s", "0",
        )  # fmt: skip

        live = wait_for_probe(port, "/live", "live", "the model to load")
        ready = probe(port, "/ready")

        assert live[0] == 200
        assert ready == (503, {"status": "redis_unreachable", "model": MODEL, "replica": "lonely"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, workers.log("lonely")
    finally:
        workers.close()
