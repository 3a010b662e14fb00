"""The one launcher of the e2e tests' server processes: the web entry point (`python -m
config.web_server`, daphne serving config.asgi with a drain on SIGTERM) and engine replicas
(`manage.py run_engine`, which becomes `python -m engine.serve`), on pytest-django's test database
and this run's Redis prefix. Each process writes its output to a log file, which a failing start
shows. `tests.e2e.stack` composes them into a serving stack; browser tests use one of each.

The processes read pytest-django's test database, so tests using them need committed rows
(`@pytest.mark.django_db(transaction=True)`, or the `committed_db` fixture).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from django.conf import settings
from django.db import connection

from config.web_command import web_command
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_url_for_tests() -> str:
    """A DATABASE_URL for the database this test process is using (pytest-django's test one)."""
    db = connection.settings_dict
    if db["ENGINE"] != "django.db.backends.postgresql":
        raise RuntimeError("browser tests need PostgreSQL (another process must reach the database)")
    auth = quote(db["USER"] or "", safe="")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"], safe="")
    host = db["HOST"] or "localhost"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{auth}{'@' if auth else ''}{host}{port}/{quote(db['NAME'], safe='')}"


# What the e2e tests read /ready's details (and /metrics) with, from the servers they start.
E2E_METRICS_TOKEN = "e2e-metrics-token"


def server_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PAGODA_METRICS_TOKEN=E2E_METRICS_TOKEN,
        DJANGO_SETTINGS_MODULE="config.settings",
        DATABASE_URL=database_url_for_tests(),
        REDIS_URL=settings.REDIS_URL,
        PAGODA_REDIS_PREFIX=settings.REDIS_PREFIX,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def wait_for_http(url: str, *, timeout: float, process: subprocess.Popen | None = None) -> None:
    def answers() -> bool:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    wait_until(answers, timeout=timeout, interval=0.2, what=f"{url} to answer")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, *, grace_s: float = 10.0) -> None:
        """SIGTERM (after SIGCONT: a paused process cannot act on it), then SIGKILL past the grace."""
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=30)


def spawn(name: str, argv: list[str], log_path: Path, **env: str) -> Process:
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        popen = subprocess.Popen(argv, cwd=ROOT, env=server_env(**env), stdout=log, stderr=subprocess.STDOUT)
    return Process(name=name, popen=popen, log_path=log_path)


def start_web(*, log_path: Path, name: str = "web", **env: str) -> tuple[Process, str]:
    """One web process (the project's entry point: daphne with a drain on SIGTERM) on a free port;
    returns it and its base URL once /live answers."""
    port = free_port()
    web = spawn(name, web_command(port), log_path, **env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(base_url + "/live", timeout=STARTUP_TIMEOUT_S, process=web.popen)
    except Exception as exc:
        web.popen.kill()
        web.popen.wait(timeout=30)
        raise RuntimeError(f"{name} did not start: {exc}\n{web.tail()}") from exc
    return web, base_url


def start_engine(
    *, model: str, log_path: Path, replica_id: str | None = None, name: str | None = None, **env: str
) -> Process:
    """One engine replica of a ModelDeployment row (committed beforehand). The machine's few cores
    are shared by every process here: one thread per engine keeps them from oversubscribing. It is
    returned at once; `wait_for_replica` waits for its heartbeat."""
    argv = [sys.executable, "manage.py", "run_engine", "--model", model]
    if replica_id is not None:
        argv += ["--replica-id", replica_id]
    env.setdefault("OMP_NUM_THREADS", "1")
    return spawn(name or f"engine {replica_id or model}", argv, log_path, **env)


def wait_for_replica(process: Process, model: str, *, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Until a replica of ``model`` has a live heartbeat (the process's log on failure)."""
    from inference.gateway.replicas import live_replica_ids

    def live() -> bool:
        if process.popen.poll() is not None:
            raise AssertionError(f"{process.name} exited with {process.popen.returncode}")
        return bool(live_replica_ids(model))

    try:
        wait_until(live, timeout=timeout, interval=0.25, what=f"the engine of {model} to be live")
    except AssertionError as exc:
        raise RuntimeError(f"{process.name} is not live ({exc})\n{process.tail(200)}") from None


@contextlib.contextmanager
def web_server(*, log_path: Path, **env: str) -> Iterator[str]:
    """One web process for the length of the block; yields its base URL (http://127.0.0.1:PORT)."""
    web, base_url = start_web(log_path=log_path, **env)
    try:
        yield base_url
    finally:
        web.stop()


@contextlib.contextmanager
def engine_replica(*, model: str, log_path: Path, **env: str) -> Iterator[Process]:
    """One engine replica for the length of the block, yielded once its heartbeat is live."""
    engine = start_engine(model=model, log_path=log_path, **env)
    try:
        wait_for_replica(engine, model)
        yield engine
    finally:
        engine.stop()
