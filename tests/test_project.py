"""Project-level checks: layout, settings helpers and start-up refusals, zero-config defaults,
dependency directions, health, readiness and metrics."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from config.env import ImproperlyConfiguredEnv, database_from_url, envbool, envint, redis_url_checked
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


def test_no_top_level_package_shadows_the_standard_library():
    packages = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    assert packages, "expected top-level packages"
    shadowing = sorted(set(packages) & set(sys.stdlib_module_names))
    assert shadowing == []


def test_import_contracts_hold():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


def test_envbool_rejects_malformed_values(monkeypatch):
    monkeypatch.setenv("PAGODA_FLAG", "maybe")
    with pytest.raises(ImproperlyConfiguredEnv, match="PAGODA_FLAG"):
        envbool("PAGODA_FLAG", False)
    monkeypatch.setenv("PAGODA_FLAG", "yes")
    assert envbool("PAGODA_FLAG", False) is True


def test_envint_rejects_non_integers_and_values_below_minimum(monkeypatch):
    monkeypatch.setenv("PAGODA_N", "12x")
    with pytest.raises(ImproperlyConfiguredEnv, match="not an integer"):
        envint("PAGODA_N", 1)
    monkeypatch.setenv("PAGODA_N", "0")
    with pytest.raises(ImproperlyConfiguredEnv, match="below the minimum"):
        envint("PAGODA_N", 1, minimum=1)


def test_env_value_can_come_from_a_file(monkeypatch, tmp_path):
    secret = tmp_path / "n"
    secret.write_text("42\n")
    monkeypatch.delenv("PAGODA_N", raising=False)
    monkeypatch.setenv("PAGODA_N_FILE", str(secret))
    assert envint("PAGODA_N", 1) == 42


def test_database_url_parses_postgres_and_rejects_unknown_schemes():
    db = database_from_url("postgres://u:p%40ss@db.example:5433/pagoda?sslmode=require")
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == (
        "pagoda",
        "u",
        "p@ss",
        "db.example",
        "5433",
    )
    assert db["OPTIONS"] == {"sslmode": "require"}
    with pytest.raises(ImproperlyConfiguredEnv, match="not supported"):
        database_from_url("mysql://u@h/db")
    with pytest.raises(ImproperlyConfiguredEnv, match="names no database"):
        database_from_url("postgres://u@h:5432/")


def _settings_import(env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "REDIS_URL": "redis://127.0.0.1:6379/0"}
    return subprocess.run(
        [sys.executable, "-c", "import config.settings"],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_production_refuses_the_development_secret_key():
    result = _settings_import({"DEBUG": "false"})
    assert result.returncode != 0
    assert "SECRET_KEY is the development default" in result.stderr


def test_production_starts_with_real_secrets():
    result = _settings_import({"DEBUG": "false", "SECRET_KEY": "x" * 50, "API_KEY_PEPPER": "y" * 32})
    assert result.returncode == 0, result.stderr


def test_malformed_debug_value_stops_start_up():
    result = _settings_import({"DEBUG": "sometimes"})
    assert result.returncode != 0
    assert "DEBUG='sometimes' is not a boolean" in result.stderr


def test_production_refuses_the_development_api_key_pepper():
    result = _settings_import({"DEBUG": "false", "SECRET_KEY": "x" * 50})
    assert result.returncode != 0
    assert "API_KEY_PEPPER is the development default" in result.stderr


def test_a_short_secret_key_stops_start_up():
    result = _settings_import({"DEBUG": "false", "SECRET_KEY": "short", "API_KEY_PEPPER": "y" * 32})
    assert result.returncode != 0
    assert "SECRET_KEY must be at least 16 characters long" in result.stderr


def test_redis_url_with_another_scheme_is_refused():
    with pytest.raises(ImproperlyConfiguredEnv, match="must start with redis://"):
        redis_url_checked("http://127.0.0.1:6379/0")
    assert redis_url_checked("unix:///run/redis.sock") == "unix:///run/redis.sock"


_ZERO_CONFIG_PROBE = """
import django
django.setup()
from pathlib import Path
from django.conf import settings
from django.db import connection
import redis
assert not Path(settings.VAR_DIR, "redis.sock").exists(), "importing the settings started redis"
from config.embedded_redis import start_if_configured
start_if_configured()
client = redis.Redis.from_url(settings.REDIS_URL)
client.set("probe", "ok")
connection.ensure_connection()
print(connection.vendor, settings.REDIS_URL, client.get("probe").decode(), client.info("server")["redis_version"])
"""


def test_zero_config_uses_sqlite_and_an_embedded_redis_server():
    var_dir = Path(tempfile.mkdtemp(prefix="pz-"))  # short: a unix socket path has a length limit
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "DEBUG": "true",
        "PAGODA_VAR_DIR": str(var_dir),
        "DJANGO_SETTINGS_MODULE": "config.settings",
    }
    try:
        result = subprocess.run(
            [sys.executable, "-c", _ZERO_CONFIG_PROBE],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        vendor, redis_url, probe, _version = result.stdout.split()
        assert (vendor, redis_url, probe) == ("sqlite", f"unix://{var_dir}/redis.sock", "ok")
        assert (var_dir / "db.sqlite3").is_file()
    finally:
        _stop_embedded_redis(var_dir)
        shutil.rmtree(var_dir, ignore_errors=True)


def _stop_embedded_redis(var_dir: Path) -> None:
    """SHUTDOWN NOSAVE: a plain SIGTERM makes redis-server save first, and it refuses to exit
    when that save fails (as it does once its directory is gone)."""
    import redis

    pid_file = var_dir / "redis.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        redis.Redis(unix_socket_path=str(var_dir / "redis.sock")).shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # the connection closing under the reply is the success case

    def exited() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    try:
        wait_until(exited, timeout=10, interval=0.05, what="redis-server to exit")
    except AssertionError:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.django_db
def test_health_and_ready_answer_when_database_and_redis_are_up(operator_headers):
    from django.test import Client

    assert Client().get("/live").json() == {"status": "ok"}
    assert Client().get("/health").json() == {"status": "ok"}
    ready = Client(headers=operator_headers).get("/ready")
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ready",
        "checks": {"web": "ok", "database": "ok", "redis": "ok", "engines": "ok"},
        "models": {},
    }


@pytest.mark.django_db
def test_a_draining_web_process_is_live_and_not_ready(monkeypatch, operator_headers):
    from django.test import Client

    from core import draining

    monkeypatch.setattr(draining, "_draining", False)  # put back after the test
    draining.mark_draining()

    live = Client().get("/live")
    anonymous = Client().get("/ready")
    ready = Client(headers=operator_headers).get("/ready")

    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    assert (anonymous.status_code, anonymous.json()) == (503, {"status": "not_ready"})
    assert ready.status_code == 503
    assert ready.json()["status"] == "not_ready"
    assert ready.json()["checks"]["web"].startswith("draining")
    # Everything else it depends on is fine: draining alone makes it not ready.
    assert {name: check for name, check in ready.json()["checks"].items() if name != "web"} == {
        "database": "ok",
        "redis": "ok",
        "engines": "ok",
    }


@pytest.mark.django_db
def test_ready_is_503_when_redis_cannot_be_reached(monkeypatch, operator_headers):
    import redis
    from django.test import Client
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from inference import health

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    unreachable = redis.Redis(
        host="127.0.0.1", port=closed_port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    monkeypatch.setattr(health, "get_redis", lambda: unreachable)

    anonymous = Client().get("/ready")
    ready = Client(headers=operator_headers).get("/ready")

    assert (anonymous.status_code, anonymous.json()) == (503, {"status": "not_ready"})
    assert ready.status_code == 503
    assert ready.json()["status"] == "not_ready"
    assert ready.json()["checks"]["database"] == "ok"
    assert ready.json()["checks"]["redis"].startswith("redis: ConnectionError")


@pytest.mark.django_db
def test_metrics_count_requests_and_latencies_by_route_not_by_raw_path(operator_headers):
    from django.test import Client
    from prometheus_client import REGISTRY

    def requests(route: str, status: str) -> float:
        labels = {"method": "GET", "route": route, "status": status}
        return REGISTRY.get_sample_value("pagoda_http_requests_total", labels) or 0.0

    def timed(route: str) -> float:
        labels = {"method": "GET", "route": route}
        return REGISTRY.get_sample_value("pagoda_http_request_duration_seconds_count", labels) or 0.0

    before = (requests("/health", "200"), timed("/health"), requests("/v1/usage", "401"))
    client = Client()
    client.get("/health")
    client.get("/health")
    client.get("/v1/usage")
    client.get("/v1/no-such-route-9f1c")

    response = client.get("/metrics", headers=operator_headers)

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    text = response.content.decode()
    assert (requests("/health", "200"), timed("/health"), requests("/v1/usage", "401")) == (
        before[0] + 2,
        before[1] + 2,
        before[2] + 1,
    )
    assert 'pagoda_http_requests_total{method="GET",route="/health",status="200"}' in text
    assert 'pagoda_http_request_duration_seconds_bucket{le="0.005",method="GET",route="/health"}' in text
    assert "no-such-route-9f1c" not in text


@pytest.mark.django_db
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-token", "Bearer ", "Basic dGVzdA==", "Bearer test-metrics-tokenX"]
)
def test_metrics_and_ready_details_are_for_operators_only(operator_headers, authorization):
    from django.test import Client

    headers = {} if authorization is None else {"Authorization": authorization}
    metrics = Client(headers=headers).get("/metrics")
    ready = Client(headers=headers).get("/ready")

    assert metrics.status_code == 401
    assert metrics.json()["error"]["code"] == "operator_only"
    assert "pagoda_" not in metrics.content.decode()
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})


@pytest.mark.django_db
def test_without_a_token_configured_only_staff_read_metrics(settings):
    from django.contrib.auth import get_user_model
    from django.test import Client

    settings.METRICS_TOKEN = ""
    users = get_user_model().objects
    staff, tenant_user = Client(), Client()
    staff.force_login(users.create_user("ops", password="pw", is_staff=True))
    tenant_user.force_login(users.create_user("someone", password="pw"))

    assert Client(headers={"Authorization": "Bearer "}).get("/metrics").status_code == 401
    assert tenant_user.get("/metrics").status_code == 401
    assert staff.get("/metrics").status_code == 200
    assert set(staff.get("/ready").json()) == {"status", "checks", "models"}
    assert set(tenant_user.get("/ready").json()) == {"status"}
