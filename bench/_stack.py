"""The serving stack for benchmarks: Django configured in this process (rows, tokenizer), the web
process (`python -m config.web_server`: daphne) and engine replicas as subprocesses, all on one
database and one Redis key prefix of their own.

The database is PostgreSQL from DATABASE_URL when it is set, else a throwaway SQLite file; Redis is
REDIS_URL when it is set, else an embedded redis-server in a throwaway directory. Whatever this
module created (rows, Redis keys, processes, the embedded server, the directory) is removed by
`BenchStack.close()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Limits set (so admission runs its full checks) but far above anything a benchmark sends: it must
# never be what is measured. The rate fields are 32-bit integer columns.
UNTHROTTLED = {
    "requests_per_minute": 1_000_000_000,
    "tokens_per_minute": 2_000_000_000,
    "max_concurrent_requests": 1_000_000,
    "monthly_token_quota": 10**15,
}


def configure_django(*, run_id: str) -> Path:
    """Point this process (and the children it starts) at the benchmark's database and Redis, then
    set Django up. Returns the throwaway directory (SQLite file, embedded redis socket, logs)."""
    work_dir = Path(tempfile.mkdtemp(prefix="pagoda-bench-"))
    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    os.environ["PAGODA_VAR_DIR"] = str(work_dir)
    os.environ["PAGODA_REDIS_PREFIX"] = f"pagoda-bench-{run_id}:"
    os.environ.setdefault("PAGODA_ALLOW_DEV_SECRETS", "true")
    # The stack's own processes inherit it: /ready's per-model details are read with it.
    os.environ.setdefault("PAGODA_METRICS_TOKEN", f"bench-{run_id}-{os.urandom(8).hex()}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import django

    django.setup()
    from django.conf import settings

    from config.embedded_redis import start_if_configured

    start_if_configured()
    # The children reach the same server (an embedded one is found through its socket anyway).
    os.environ["REDIS_URL"] = settings.REDIS_URL
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    return work_dir


def add_engine_setting_option(parser: Any, *, help: str) -> None:  # noqa: A002 - argparse's name
    """`--engine-setting KEY=VALUE` (a JSON value), repeatable: deployment engine_settings entries."""
    parser.add_argument("--engine-setting", action="append", default=[], metavar="KEY=VALUE", help=help)


def engine_settings_from(items: list[str], defaults: dict[str, Any]) -> dict[str, Any]:
    """`defaults` with the `--engine-setting` entries over them."""
    settings = dict(defaults)
    for item in items:
        key, _, value = item.partition("=")
        settings[key] = json.loads(value)
    return settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class BenchStack:
    run_id: str
    work_dir: Path
    model: str
    model_dir: Path
    api_key: str
    tenant_id: int
    base_url: str = ""
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def database(self) -> str:
        from django.conf import settings

        return settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]

    @property
    def redis(self) -> str:
        from django.conf import settings

        return "embedded" if settings.REDIS_URL.startswith("unix://") else "REDIS_URL"

    @property
    def api_base(self) -> str:
        return self.base_url + "/v1"

    def log_path(self, name: str) -> Path:
        return self.work_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def start(
        self,
        *,
        threads: int,
        timeout_s: float = 300.0,
        replicas: tuple[str, ...] = ("bench",),
        cpus: dict[str, str] | None = None,
    ) -> None:
        """Start daphne and one engine replica per id in `replicas` (the first one's process is
        named "engine", the others "engine-<id>"), and wait for /ready. `cpus`: a replica's CPU
        list (`taskset -c`), to pin it to cores of its own."""
        from config.web_command import web_command

        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        engine = [sys.executable, "manage.py", "run_engine", "--model", self.model, "--replica-id"]
        pinned = {r: ["taskset", "-c", c] for r, c in (cpus or {}).items()}
        argv = {
            **{
                "engine" if i == 0 else f"engine-{replica}": [*pinned.get(replica, []), *engine, replica]
                for i, replica in enumerate(replicas)
            },
            # The web entry point users run (daphne with a drain and a listen backlog).
            "daphne": web_command(port, "-v", "0"),
        }
        for name, command in argv.items():
            with open(self.log_path(name), "wb") as log:
                self.processes[name] = subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                )
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack was not ready after {timeout_s}s:\n{self.log_tail('engine')}")
            time.sleep(0.25)

    def ready(self, replicas: int = 0) -> bool:
        """This model's entry in /ready says ready (with at least `replicas` live replicas; 0: all
        that this stack started)."""
        # /ready is 503 while any enabled model lacks a replica; only this model's entry matters here.
        request = urllib.request.Request(
            self.base_url + "/ready",
            headers={"Authorization": f"Bearer {os.environ['PAGODA_METRICS_TOKEN']}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read())
            except ValueError:
                return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
        if body.get("checks", {}).get("web") != "ok":  # draining, or still warming up
            return False
        entry = body.get("models", {}).get(self.model, {})
        wanted = replicas or sum(name.startswith("engine") for name in self.processes)
        return bool(entry.get("ready")) and len(entry.get("replicas", [])) >= wanted

    def stop(self, grace_s: float = 20.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)

    def keep_logs(self) -> Path:
        """Copy the processes' logs out of the directory `close()` removes; returns where they are."""
        kept = Path(tempfile.mkdtemp(prefix=f"pagoda-bench-logs-{self.run_id}-"))
        for name in self.processes:
            with contextlib.suppress(OSError):
                shutil.copy(self.log_path(name), kept / f"{name}.log")
        return kept

    def close(self) -> None:
        """Stop the processes and remove what the benchmark wrote."""
        self.stop()
        from django.conf import settings

        from core.redis_client import get_redis
        from inference.models import ModelDeployment
        from tenants.models import Tenant, UsageDaily, UsageRecord

        # The ledger protects the keys it names: its rows go first. Each delete on its own, so one
        # failure does not leave the deployment behind (an enabled model with no replica makes
        # /ready report not ready).
        for rows in (
            UsageRecord.objects.filter(tenant_id=self.tenant_id),
            UsageDaily.objects.filter(tenant_id=self.tenant_id),
            Tenant.objects.filter(pk=self.tenant_id),
            ModelDeployment.objects.filter(name=self.model),
        ):
            try:
                rows.delete()
            except Exception as exc:
                print(f"could not remove {rows.model.__name__} rows: {exc}", file=sys.stderr)
        redis = get_redis()
        with contextlib.suppress(Exception):
            for key in redis.scan_iter(match=settings.REDIS_PREFIX + "*", count=1000):
                redis.delete(key)
        pid_file = self.work_dir / "redis.pid"
        if pid_file.exists():  # the embedded server this run started, if any
            with contextlib.suppress(ProcessLookupError, ValueError):
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                # It writes its snapshot into the directory on the way out: wait, then remove it.
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    os.kill(pid, 0)
                    time.sleep(0.05)
                os.kill(pid, signal.SIGKILL)  # it refuses to stop when that snapshot fails
        shutil.rmtree(self.work_dir, ignore_errors=True)


def create_stack(
    *,
    model_dir: Path,
    engine_settings: dict[str, Any],
    dtype: str | None = None,
    max_model_len: int | None = None,
    max_queued: int | None = None,
) -> BenchStack:
    """Configure Django, register the model and an unthrottled tenant with a key (not started yet).

    `max_queued`: the requests that may wait to start, on the model and for the tenant (the
    platform's defaults, 256 and 64, when None); a load of N concurrent clients sets N, so that
    what is measured is the serving path, not its queue bounds."""
    run_id = uuid.uuid4().hex[:8]
    work_dir = configure_django(run_id=run_id)
    from inference.services import deployment_register
    from tenants.services import api_key_create, tenant_create

    model = f"bench-{run_id}"
    options: dict[str, Any] = {"max_model_len": max_model_len}
    if dtype is not None:
        options["dtype"] = dtype
    deployment, _ = deployment_register(
        name=model, model_path=model_dir, engine_settings=engine_settings, **options
    )
    limits: dict[str, Any] = dict(UNTHROTTLED)
    if max_queued is not None:
        deployment.max_queued_requests = max_queued
        deployment.save(update_fields=["max_queued_requests"])
        limits["max_queued_requests"] = max_queued
    tenant = tenant_create(name=f"Bench {run_id}", slug=f"bench-{run_id}", allowed_models=[model], **limits)
    _, raw_key = api_key_create(tenant=tenant, name="bench")
    return BenchStack(
        run_id=run_id,
        work_dir=work_dir,
        model=model,
        model_dir=model_dir,
        api_key=raw_key,
        tenant_id=tenant.pk,
    )
