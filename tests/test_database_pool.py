"""A web process holds at most PAGODA_DB_POOL_MAX PostgreSQL connections, however many request
threads do database work at once (ASGI gives every request a thread of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[1]

BURST = textwrap.dedent(
    """
    import threading
    import django
    django.setup()
    from django.db import connection

    errors = []

    def request_thread():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_sleep(0.3)")
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            connection.close()  # what Django does when a request ends: back to the pool

    threads = [threading.Thread(target=request_thread) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("errors", len(errors), errors[:1])
    """
)


def _peak_connections(database_url: str, app_name: str, pool_max: str) -> tuple[int, str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": f"{database_url}?application_name={app_name}",
        "PAGODA_DB_POOL_MAX": pool_max,
        "PYTHONPATH": str(ROOT),
    }
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        with psycopg.connect(database_url, autocommit=True) as conn:
            while not stop.is_set():
                (count,) = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app_name,)
                ).fetchone()
                peak = max(peak, count)
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        done = subprocess.run(
            [sys.executable, "-c", BURST], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
        )
    finally:
        stop.set()
        watcher.join()
    assert done.returncode == 0, done.stderr[-2000:]
    return peak, done.stdout


@pytest.fixture
def database_url() -> str:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        pytest.skip("needs DATABASE_URL pointing at PostgreSQL (scripts/test.sh sets it)")
    return url


def test_a_burst_of_request_threads_shares_a_bounded_pool_of_connections(database_url):
    peak, out = _peak_connections(database_url, f"pagoda-pool-{uuid.uuid4().hex[:8]}", "3")

    assert "errors 0 " in out
    assert 1 <= peak <= 3


def test_without_the_pool_every_request_thread_opens_its_own_connection(database_url):
    peak, out = _peak_connections(database_url, f"pagoda-nopool-{uuid.uuid4().hex[:8]}", "0")

    assert "errors 0 " in out
    assert peak > 3


KEPT = textwrap.dedent(
    """
    import asyncio
    import django
    django.setup()
    from django.db import connections
    from core.concurrency import blocking

    def query():
        wrapper = connections["default"]  # this thread's own (django.db.connection is a proxy)
        with wrapper.cursor() as cursor:
            cursor.execute("SELECT 1")
        return wrapper

    async def main():
        wrapper = await blocking(query)()
        print("vendor", wrapper.vendor, "open", wrapper.connection is not None)

    asyncio.run(main())
    """
)


def _after_blocking(env: dict[str, str]) -> str:
    env = {**env, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", KEPT], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_blocking_call_gives_its_postgresql_connection_back(database_url):
    assert "vendor postgresql open False" in _after_blocking({**os.environ, "DATABASE_URL": database_url})


def test_a_blocking_call_keeps_its_thread_s_sqlite_connection_open(tmp_path):
    """The zero-config SQLite file: no server holds a connection, and reopening one (with its
    pragmas) costs several times the query."""
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(PAGODA_VAR_DIR=str(tmp_path), PAGODA_ALLOW_DEV_SECRETS="true")
    assert "vendor sqlite open True" in _after_blocking(env)
