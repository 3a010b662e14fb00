"""Run one engine replica of a model deployment: `python manage.py run_engine --model NAME`.

Thin: reads the deployment row and the Redis settings, then replaces this process with
`python -m engine.serve ...`, so the engine never shares a process with Django.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from engine.rules import (
    ENGINE_SETTING_DEFAULTS,
    ENGINE_SETTING_FLAGS,
    ENGINE_SETTING_SWITCHES,
    engine_settings_errors,
)
from inference.selectors import deployment_get_enabled


def serve_argv(
    *,
    name: str,
    model_path: str,
    max_model_len: int,
    dtype: str,
    engine_settings: dict[str, Any],
    replica_id: str = "",
    task: str = "auto",
) -> list[str]:
    """The engine's command line for a deployment; refuses engine_settings keys it does not know.

    The Redis URL is not on it (it may hold a password, and command lines are public): the engine
    reads REDIS_URL from the environment, which `engine_env` sets.
    """
    errors = engine_settings_errors(engine_settings)
    if errors:
        raise CommandError(f"model {name!r}: engine_settings: {'; '.join(errors)}")
    heartbeat_ttl = float(settings.ENGINE_HEARTBEAT_TTL)
    argv = [
        sys.executable,
        "-m",
        "engine.serve",
        f"--model-dir={model_path}",
        f"--served-name={name}",
        f"--task={task}",
        f"--max-model-len={max_model_len}",
        f"--dtype={dtype}",
        f"--redis-prefix={settings.REDIS_PREFIX}",
        f"--output-ttl={settings.OUTPUT_STREAM_TTL}",
        f"--heartbeat-ttl={heartbeat_ttl}",
    ]
    if "heartbeat_interval" not in engine_settings:
        # Several beats per TTL, so one late beat does not make the replica look dead.
        argv.append(f"--heartbeat-interval={min(1.0, heartbeat_ttl / 3)}")
    if "claim_timeout_ms" not in engine_settings:  # the deployment's own wins over the platform's
        argv.append(f"{ENGINE_SETTING_FLAGS['claim_timeout_ms']}={settings.REQUEST_CLAIM_TIMEOUT_MS}")
    if "max_failovers" not in engine_settings:
        argv.append(f"{ENGINE_SETTING_FLAGS['max_failovers']}={settings.MAX_FAILOVERS}")
    for key, value in {**ENGINE_SETTING_DEFAULTS, **engine_settings}.items():
        if key in ENGINE_SETTING_SWITCHES:
            if value:
                argv.append(ENGINE_SETTING_SWITCHES[key])
        elif value is not None:
            argv.append(f"{ENGINE_SETTING_FLAGS[key]}={value}")
    if replica_id:
        argv.append(f"--replica-id={replica_id}")
    if settings.ENGINE_HEALTH_PORT:
        argv.append(f"--health-port={settings.ENGINE_HEALTH_PORT}")
    return argv


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env["REDIS_URL"] = settings.REDIS_URL
    # `-m engine.serve` must import from this project wherever manage.py was started from.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(settings.BASE_DIR), env.get("PYTHONPATH", "")) if p)
    return env


class Command(BaseCommand):
    help = "Run one engine replica serving a model deployment (replaces this process with the engine)."

    def add_arguments(self, parser):
        parser.add_argument("--model", required=True, help="served name of an enabled ModelDeployment")
        parser.add_argument("--replica-id", default="", help="default: host-pid-random")
        parser.add_argument("--print-command", action="store_true", help="print the engine command and exit")

    def handle(self, *args, model: str, replica_id: str, print_command: bool, **options):
        deployment = deployment_get_enabled(name=model)
        if deployment is None:
            raise CommandError(f"no enabled model deployment named {model!r}")
        argv = serve_argv(
            name=deployment.name,
            model_path=deployment.model_path,
            max_model_len=deployment.max_model_len,
            dtype=deployment.dtype,
            engine_settings=dict(deployment.engine_settings or {}),
            replica_id=replica_id,
            task=deployment.task,
        )
        if print_command:
            self.stdout.write(shlex.join(argv))
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(argv[0], argv, engine_env())
