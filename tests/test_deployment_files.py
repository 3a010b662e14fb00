"""docker-compose.yml and the Dockerfile cannot be run here (no Docker engine): check them by reading."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _command(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_compose_has_every_process_of_the_platform():
    services = _compose()["services"]
    assert {"postgres", "redis", "web", "engine", "celery-worker", "celery-beat"} <= set(services)


def test_compose_services_run_the_right_commands():
    services = _compose()["services"]
    assert _command(services["web"])[:3] == ["python", "-m", "config.web_server"]
    assert "config.asgi:application" in _command(services["web"])
    assert "run_engine" in " ".join(_command(services["engine"]))
    assert _command(services["celery-worker"])[:4] == ["celery", "-A", "config", "worker"]
    # Batch runners on a queue of their own (CELERY_TASK_ROUTES), which some worker must consume.
    assert _command(services["celery-batches"])[:6] == ["celery", "-A", "config", "worker", "-Q", "batches"]
    assert _command(services["celery-beat"])[:4] == ["celery", "-A", "config", "beat"]
    assert _command(services["migrate"])[-3:] == ["manage.py", "migrate", "--noinput"]


def test_compose_gives_draining_processes_more_than_their_grace_period_before_sigkill():
    services = _compose()["services"]
    for name in ("web", "engine"):
        assert int(services[name]["stop_grace_period"].removesuffix("s")) > 30, name


def test_compose_stateful_services_have_health_checks_and_volumes():
    compose = _compose()
    services = compose["services"]
    for name in ("postgres", "redis", "web", "engine", "celery-worker"):
        assert "healthcheck" in services[name], name
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    assert {"pgdata", "redisdata", "models", "media"} <= set(compose["volumes"])


def test_app_services_wait_for_healthy_database_and_redis():
    services = _compose()["services"]
    for name in ("web", "engine", "celery-worker", "celery-beat", "migrate"):
        env = services[name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://"), name
        assert env["REDIS_URL"].startswith("redis://redis:6379"), name
    migrate_deps = services["migrate"]["depends_on"]
    assert migrate_deps["postgres"]["condition"] == "service_healthy"
    assert migrate_deps["redis"]["condition"] == "service_healthy"
    for name in ("web", "engine", "celery-worker", "celery-beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_management_commands_named_in_compose_exist():
    services = _compose()["services"]
    engine_cmd = " ".join(_command(services["engine"]))
    health_cmd = " ".join(services["engine"]["healthcheck"]["test"])
    for command in ("run_engine", "engine_alive"):
        assert command in engine_cmd + health_cmd
        assert (ROOT / "inference" / "management" / "commands" / f"{command}.py").is_file(), command


def test_dockerfile_installs_requirements_and_serves_asgi():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install -r requirements.txt" in dockerfile
    assert "config.asgi:application" in dockerfile
    assert "\nUSER " in dockerfile


def test_compose_restarts_every_long_running_service_and_persists_redis_every_second():
    services = _compose()["services"]
    for name in ("postgres", "redis", "web", "engine", "celery-worker", "celery-beat"):
        assert services[name]["restart"] in ("unless-stopped", "always", "on-failure"), name
    for name in ("migrate", "demo-model"):
        assert services[name]["restart"] == "no", name
    redis_cmd = _command(services["redis"])
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert redis_cmd[redis_cmd.index("--appendfsync") + 1] == "everysec"


def test_compose_serves_smollm2_by_default_and_registers_it_before_the_engine_starts():
    services = _compose()["services"]
    assert services["engine"]["environment"]["MODEL"] == "smollm2"
    assert "MODEL:-smollm2" in " ".join(_command(services["engine"]))
    setup = " ".join(_command(services["demo-model"]))
    assert "fetch-demo-model" in setup and "model_register --name smollm2" in setup
    assert services["engine"]["depends_on"]["demo-model"]["condition"] == "service_completed_successfully"
