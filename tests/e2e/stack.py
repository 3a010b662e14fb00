"""A real serving stack for end-to-end tests: the web entry point (`python -m config.web_server`,
daphne serving config.asgi) and engine replicas (`manage.py run_engine`, which becomes
`python -m engine.serve`), all on pytest-django's test database and this run's Redis prefix, driven
through the official clients.

Every process writes its output to a log file; `log_tails()` is what a failing test shows.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from core.redis_client import get_redis
from engine.protocol import CONSUMER_GROUP, ReplicaStats, replica_stats_key
from engine.worker.queue import model_request_streams
from tests.conftest import World, make_world
from tests.e2e.processes import E2E_METRICS_TOKEN, STARTUP_TIMEOUT_S, Process, start_engine, start_web
from tests.helpers import wait_until

# The replicas' blocking read of the request stream (WorkerSettings.idle_block_ms, left as it is).
IDLE_BLOCK_MS = 200


@dataclass
class ServingStack:
    base_url: str
    model: str
    web: Process
    replicas: dict[str, Process] = field(default_factory=dict)

    @property
    def api_base(self) -> str:
        return self.base_url + "/v1"

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://", 1) + "/ws/v1/chat"

    def client(self, api_key: str, *, timeout: float = 60.0):
        """The official OpenAI client, without retries (a retried 429 or 5xx would hide what is tested)."""
        import openai

        return openai.OpenAI(base_url=self.api_base, api_key=api_key, max_retries=0, timeout=timeout)

    # --- what the engines report ----------------------------------------------------------------

    def replica_stats(self) -> dict[str, ReplicaStats]:
        """The last heartbeat of each replica of the model that still has one (read from Redis)."""
        redis = get_redis()
        stats = {}
        for replica_id in self.replicas:
            raw = redis.get(replica_stats_key(settings.REDIS_PREFIX, self.model, replica_id))
            if raw is not None:
                stats[replica_id] = ReplicaStats.decode(raw)
        return stats

    def ready(self) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            self.base_url + "/ready", headers={"Authorization": f"Bearer {E2E_METRICS_TOKEN}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def holders(self) -> list[str]:
        """The replica holding each request of the model's stream that is taken and not yet acked."""
        redis = get_redis()
        rows = [
            row
            for stream in model_request_streams(redis, settings.REDIS_PREFIX, self.model)
            for row in _pending_rows(redis, stream)
        ]
        return [
            row["consumer"].decode() if isinstance(row["consumer"], bytes) else row["consumer"]
            for row in rows
        ]

    # --- controlling processes ------------------------------------------------------------------

    def kill(self, replica_id: str) -> None:
        process = self.replicas[replica_id].popen
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)

    @contextlib.contextmanager
    def paused(self, replica_id: str, *, settle_ms: int = IDLE_BLOCK_MS + 300) -> Iterator[None]:
        """Stop a replica (SIGSTOP) so that the others take every new request, then resume it.

        The pause waits out the replica's blocking stream read first: Redis would otherwise hand
        a new request to the frozen process's pending read. That read's end cannot be observed
        (Redis 7.0's XINFO counts a consumer's idle time from its last delivery, not from its last
        read), so this is time passing beyond the read's block time, not a wait for a condition.
        """
        process = self.replicas[replica_id].popen
        process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(settle_ms / 1000)
            yield
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)

    def assert_refusing(self, client: Any, *, down: str) -> None:
        """While a dependency (`down`: the check of /ready that names it) is unavailable: a new
        request gets an OpenAI-shaped 503 that says when to retry, never a 500 or a page, and /ready
        says not_ready."""
        import openai

        try:
            client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        except openai.APIStatusError as refused:
            assert refused.status_code == 503
            assert refused.body["code"] == "service_unavailable"
            assert int(refused.response.headers["retry-after"]) > 0
        else:
            raise AssertionError(f"a request was served while {down} was down")
        status, body = self.ready()
        assert (status, body["status"], body["checks"][down] != "ok") == (503, "not_ready", True)

    def wait_until(
        self, predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1
    ) -> Any:
        return wait_until(predicate, timeout=timeout, interval=interval, what=what)

    def log_tails(self, lines: int = 40) -> str:
        parts = []
        for process in [self.web, *self.replicas.values()]:
            status = process.popen.poll()
            state = "running" if status is None else f"exited {status}"
            parts.append(f"--- {process.name} ({state}) {process.log_path} ---\n{process.tail(lines)}")
        return "\n".join(parts)

    def stop(self, *, grace_s: float = 5.0) -> None:
        """SIGTERM to every process at once (engines and web drain), SIGKILL to stragglers."""
        processes = [p.popen for p in [self.web, *self.replicas.values()] if p.popen.poll() is None]
        for popen in processes:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
                popen.terminate()
        deadline = time.monotonic() + grace_s
        for popen in processes:
            try:
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(timeout=30)


@contextlib.contextmanager
def serving_stack(
    *, model: str, replica_ids: list[str], log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[ServingStack]:
    """Start the engine replicas of `model` (a ModelDeployment row committed beforehand) and a web
    process, and yield once /ready shows every replica's heartbeat. Everything is killed on the way
    out."""
    env = dict(env or {})
    replicas = {
        replica_id: start_engine(
            model=model, replica_id=replica_id, log_path=log_dir / f"engine-{replica_id}.log", **env
        )
        for replica_id in replica_ids
    }
    try:
        web, base_url = start_web(log_path=log_dir / "web.log", **env)
    except Exception:
        for process in replicas.values():
            process.popen.kill()
            process.popen.wait(timeout=30)
        raise
    stack = ServingStack(base_url=base_url, model=model, web=web, replicas=replicas)
    try:
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S

            def all_replicas_ready() -> bool:
                for process in replicas.values():
                    if process.popen.poll() is not None:
                        raise RuntimeError(f"{process.name} exited with {process.popen.returncode}")
                status, body = stack.ready()
                live = {r["replica_id"] for r in body.get("models", {}).get(model, {}).get("replicas", [])}
                return status == 200 and live == set(replica_ids)

            stack.wait_until(
                all_replicas_ready, timeout=deadline - time.monotonic(), what=f"{model} ready", interval=0.25
            )
        except Exception as exc:
            raise RuntimeError(f"the serving stack did not start: {exc}\n{stack.log_tails()}") from exc
        yield stack
    finally:
        stack.stop()


@contextlib.contextmanager
def served_world(
    committed_db: Callable[[], contextlib.AbstractContextManager],
    tmp_path_factory: Any,
    *,
    replica_ids: list[str],
    engine_settings: dict[str, Any],
    max_model_len: int = 2048,
    env: dict[str, str] | None = None,
    task: str | None = None,
    **world: Any,
) -> Iterator[tuple[World, ServingStack]]:
    """The e2e tests' world: make_world's tenants and keys (its arguments in ``world``) and a model
    deployment on the CPU (``engine_settings`` over blocks of 16 tokens; ``task`` where it is not
    the model's own) committed, then a serving stack of that model with ``replica_ids``."""
    deployment: dict[str, Any] = {
        "max_model_len": max_model_len,
        "engine_settings": {"device": "cpu", "block_size": 16, **engine_settings},
    }
    if task is not None:
        deployment["task"] = task
    with committed_db():
        base = make_world(deployment=deployment, **world)
    log_dir = tmp_path_factory.mktemp(f"e2e-{base.model}-logs")
    with serving_stack(model=base.model, replica_ids=replica_ids, log_dir=log_dir, env=env) as stack:
        yield base, stack


def real_model_world(
    committed_db: Callable[[], contextlib.AbstractContextManager],
    tmp_path_factory: Any,
    model_dir: Path,
    *,
    model: str,
    tenant: str,
    max_num_seqs: int,
) -> contextlib.AbstractContextManager[tuple[World, ServingStack]]:
    """served_world for the real model (SmolLM2-135M-Instruct from ``model_dir``): one replica,
    256 blocks, and one tenant of that name. Its grammars may take 40 ms a token mask (the
    default bound is 8 ms of CPU time): on a loaded test machine an ordinary schema's masks (1-3 ms
    when idle; `maxLength: 40` strings) were timed above 8 ms and refused, which these tests, about
    the APIs, must not depend on; the bound itself is tested in tests/engine/test_structured_output_costs.py."""
    return served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["solo"],
        model=model,
        model_dir=model_dir,
        engine_settings={"num_blocks": 256, "max_num_seqs": max_num_seqs, "grammar_max_mask_ms": 40},
        tenant_a={"name": tenant.title(), "slug": f"e2e-{tenant}"},
    )


@dataclass
class OpenStream:
    """A greedy chat stream (eos ignored, so it runs to max_tokens) and the chunks read so far."""

    stream: Any
    request_id: str
    chunks: Iterator[Any]
    received: list[Any]


def open_stream(
    client: Any,
    *,
    model: str,
    messages: list[dict],
    max_tokens: int,
    first: int = 0,
    include_usage: bool = False,
) -> OpenStream:
    """Start a long greedy chat stream and read its first ``first`` chunks."""
    import openai

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True} if include_usage else openai.omit,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    received = [next(chunks) for _ in range(first)]
    return OpenStream(stream, stream.response.headers["x-request-id"], chunks, received)


def _pending_rows(redis, stream: str) -> list[dict]:
    try:
        return redis.xpending_range(stream, CONSUMER_GROUP, "-", "+", 100)
    except Exception:  # a replica's stream retired between the two reads
        return []
