"""Soak: a mixed load for --minutes with a fault every --fault-every seconds, then the books.

The platform runs as `scripts/up.sh` runs it, under supervisord (which restarts what dies): a
redis-server of its own (append-only file, fsync every second), two web processes, one engine
replica, a Celery worker and beat; PostgreSQL is a cluster of its own (initdb in a temp directory).
Everything is removed at the end.

Load (--clients threads, each sending one request at a time, to either web process):
- REST, SSE and websocket chat requests, in turn;
- two tenants: one on the base model, one on its LoRA adapter (uploaded through the API and
  validated by the Celery worker);
- a third of the requests under a JSON schema (structured outputs), the rest free.

Faults, in turn: the engine SIGKILLed, a web process SIGKILLed, Redis restarted (SIGTERM; the
supervisor starts it again), PostgreSQL restarted (pg_ctl restart -m fast).

Final JSON line: requests, completed, clean_errors (an OpenAI-shaped error), resets (anything
else: a dropped connection, a timeout, a malformed answer); ledger_mismatches (a completed
request whose ledger row is missing or bills other tokens than the client was told, or a stream
that failed after it started with no row); leaked_reservations (concurrency slots, reservations and
open settlements left once idle); rss_growth_pct of each process over the last 20 minutes (of its
current pid, after a minute of warm-up); redis_used_memory_mb at start and end; and the engine's
KV blocks in use when idle. Targets: 0, 0, <= 5 %, 0.

    .venv/bin/python bench/soak.py                        # 30 minutes, a fault every 3
    .venv/bin/python bench/soak.py --minutes 4 --fault-every 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._stack import free_port  # noqa: E402
from bench.multi_lora import make_adapters, model_dir  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
MODEL = "soak"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
}
PROMPTS = ["Name a city by the sea.", "What is a pagoda?", "Count to five.", "Say hello in French."]
FAULTS = ("engine", "web", "redis", "postgres")


@dataclass
class Outcome:
    kind: str  # rest | sse | ws
    result: str  # completed | clean_error | reset
    request_id: str | None = None
    completion_tokens: int | None = None  # as the client was told (completed)
    started: bool = False  # a stream that had begun (its failure must still be billed)
    code: str | None = None


@dataclass
class Soak:
    work: Path
    args: argparse.Namespace
    env: dict[str, str] = field(default_factory=dict)
    ports: list[int] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    samples: list[tuple[float, dict[str, tuple[int, int]]]] = field(
        default_factory=list
    )  # t, name -> (pid, rss)
    redis_mb: list[tuple[int, float]] = field(default_factory=list)  # s since start, used_memory
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def conf(self) -> Path:
        return self.work / "supervisord.conf"

    def ctl(self, *args: str) -> str:
        done = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "supervisorctl"), "-c", str(self.conf), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout.strip()

    def pid(self, program: str) -> int:
        try:
            return int(self.ctl("pid", program))
        except ValueError:
            return 0


def _program(name: str, command: str) -> str:
    return (
        f"[program:{name}]\ncommand={command}\ndirectory={ROOT}\nautostart={'true' if name == 'redis' else 'false'}\n"
        "autorestart=true\nstartsecs=2\nstartretries=1000000\nstopsignal=TERM\nstopwaitsecs=45\n"
        "stopasgroup=true\nkillasgroup=true\n"
        f"stdout_logfile=%(here)s/{name}.log\nstdout_logfile_maxbytes=50MB\nredirect_stderr=true\n\n"
    )


def write_supervisor_conf(soak: Soak) -> None:
    work = soak.work
    programs = [("redis", f"{PY} -m config.embedded_redis {work}")]
    for i, port in enumerate(soak.ports, start=1):
        programs.append(
            (f"web-{i}", f"{PY} -m config.web_server -b 127.0.0.1 -p {port} config.asgi:application")
        )
    programs += [
        ("engine", f"{PY} manage.py run_engine --model {MODEL}"),
        (
            "celery-worker",
            f"{ROOT}/.venv/bin/celery -A config worker --loglevel=warning --concurrency=1 "
            "--without-gossip --without-mingle --without-heartbeat",
        ),
        ("celery-beat", f"{ROOT}/.venv/bin/celery -A config beat --loglevel=warning --schedule={work}/beat"),
    ]
    env = ",".join(f'{k}="{v}"' for k, v in soak.env.items())
    text = (
        f"[supervisord]\nnodaemon=true\nlogfile={work}/supervisord.log\npidfile={work}/supervisord.pid\n"
        f"environment={env}\n\n"
        f"[unix_http_server]\nfile={work}/supervisor.sock\nchmod=0700\n\n"
        f"[supervisorctl]\nserverurl=unix://{work}/supervisor.sock\n\n"
        "[rpcinterface:supervisor]\nsupervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n\n"
    )
    soak.conf.write_text(text + "".join(_program(n, c) for n, c in programs))


def wait_for(predicate, *, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise RuntimeError(f"timed out waiting for {what}")


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


# --- the load -----------------------------------------------------------------------------------


def _body(rng: random.Random, model: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(8, 48),
        "temperature": 0.7,
    }
    if rng.random() < 1 / 3:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    return body


def _rest(client, body: dict) -> Outcome:
    import openai

    try:
        raw = client.chat.completions.with_raw_response.create(**body)
    except openai.APIStatusError as exc:
        shaped = isinstance(exc.body, dict) and {"message", "type"} <= set(exc.body)
        return Outcome(
            "rest",
            "clean_error" if shaped else "reset",
            exc.response.headers.get("x-request-id"),
            code=getattr(exc, "code", None),
        )
    except openai.APIError:
        return Outcome("rest", "reset")
    reply = raw.parse()
    return Outcome("rest", "completed", raw.headers["x-request-id"], reply.usage.completion_tokens)


def _sse(client, body: dict) -> Outcome:
    import openai

    outcome = Outcome("sse", "reset")
    try:
        stream = client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
        outcome.request_id, outcome.started = stream.response.headers.get("x-request-id"), True
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None:
            return outcome
        outcome.result, outcome.completion_tokens = "completed", usage.completion_tokens
    except openai.APIStatusError as exc:
        outcome.request_id = outcome.request_id or exc.response.headers.get("x-request-id")
        outcome.result, outcome.code = "clean_error", getattr(exc, "code", None)
    except openai.APIError as exc:
        # An error event inside a started stream is OpenAI-shaped; a cut connection is not.
        if getattr(exc, "code", None):
            outcome.result, outcome.code = "clean_error", exc.code
    return outcome


def _ws(port: int, key: str, body: dict) -> Outcome:
    import websocket

    outcome = Outcome("ws", "reset")
    try:
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{port}/ws/v1/chat",
            subprotocols=["pagoda.v1", f"pagoda.bearer.{key}"],
            timeout=60,
        )
    except Exception:
        return outcome
    try:
        ws.send(json.dumps({"type": "chat", "id": "s", "request": body}))
        while True:
            message = json.loads(ws.recv())
            if message.get("type") == "delta":
                outcome.started = True
            elif message.get("type") == "done":
                outcome.result, outcome.request_id = "completed", message.get("request_id")
                outcome.completion_tokens = message["usage"]["completion_tokens"]
                return outcome
            elif message.get("type") == "error":
                error = message.get("error") or {}
                if {"message", "type"} <= set(error):
                    outcome.result, outcome.code = "clean_error", error.get("code")
                return outcome
    except Exception:
        return outcome
    finally:
        ws.close()


def client_loop(soak: Soak, index: int, tenants: list[tuple[str, str]]) -> None:
    import openai

    rng = random.Random(1000 + index)
    clients = {
        port: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        for port in soak.ports
        for key, _ in tenants[:1]
    }
    kinds = ("rest", "sse", "ws")
    turn = index
    while not soak.stop.is_set():
        key, model = tenants[turn % len(tenants)]
        kind = kinds[turn % 3]
        port = rng.choice(soak.ports)
        turn += 1
        body = _body(rng, model)
        client = clients[port] if key == tenants[0][0] else clients[port].with_options(api_key=key)
        outcome = (
            _rest(client, body)
            if kind == "rest"
            else _sse(client, body)
            if kind == "sse"
            else _ws(port, key, body)
        )
        with soak.lock:
            soak.outcomes.append(outcome)
        if outcome.result != "completed":
            time.sleep(0.5)  # a fault is on: no hammering


# --- faults and samples -------------------------------------------------------------------------


def fault_loop(soak: Soak, pg) -> None:
    turn = 0
    while not soak.stop.wait(soak.args.fault_every):
        fault = FAULTS[turn % len(FAULTS)]
        if fault == "engine":
            os.kill(soak.pid("engine"), signal.SIGKILL)
        elif fault == "web":
            os.kill(soak.pid(f"web-{1 + (turn // len(FAULTS)) % len(soak.ports)}"), signal.SIGKILL)
        elif fault == "redis":
            os.kill(soak.pid("redis"), signal.SIGTERM)  # it saves; the supervisor starts it again
        else:
            pg.stop()
            pg.start()
        with soak.lock:
            soak.faults.append((time.monotonic(), fault))
        print(f"[soak] fault: {fault}", flush=True)
        turn += 1


def sample_loop(soak: Soak, programs: list[str]) -> None:
    import psutil

    started = time.monotonic()
    while True:
        try:
            soak.redis_mb.append((round(time.monotonic() - started), redis_memory_mb(soak.work)))
        except Exception:  # restarting
            pass
        row = {}
        for name in programs:
            pid = soak.pid(name)
            try:
                row[name] = (pid, psutil.Process(pid).memory_info().rss)
            except (psutil.Error, ValueError):
                continue
        soak.samples.append((time.monotonic(), row))
        if soak.stop.wait(30):
            return


def rss_growth(soak: Soak, window_s: float) -> dict[str, float]:
    end = soak.samples[-1][0]
    growth = {}
    for name, (final_pid, final_rss) in soak.samples[-1][1].items():
        own = [(t, row[name][1]) for t, row in soak.samples if name in row and row[name][0] == final_pid]
        born = own[0][0]
        window = [rss for t, rss in own if t >= max(end - window_s, born + 60)]
        if len(window) >= 2:
            growth[name] = round(100.0 * (final_rss - window[0]) / window[0], 2)
    return growth


def redis_keys(work: Path, prefix: str) -> dict[str, dict[str, float]]:
    """Keys by kind (the first part of the name after the prefix): how many, how many without a
    TTL, and their memory (MiB): where Redis's memory goes, and what never expires."""
    import redis

    client = redis.Redis(unix_socket_path=str(work / "redis.sock"))
    kinds: dict[str, dict[str, float]] = {}
    for key in client.scan_iter(match=prefix + "*", count=1000):
        kind = key.decode()[len(prefix) :].split(":", 1)[0]
        row = kinds.setdefault(kind, {"keys": 0, "no_ttl": 0, "mb": 0.0})
        row["keys"] += 1
        row["no_ttl"] += client.ttl(key) == -1
        row["mb"] += (client.memory_usage(key, samples=0) or 0) / 2**20
    return {k: {**v, "mb": round(v["mb"], 2)} for k, v in sorted(kinds.items())}


def redis_memory_mb(work: Path) -> float:
    import redis

    info = redis.Redis(unix_socket_path=str(work / "redis.sock")).info("memory")
    return round(info["used_memory"] / 2**20, 2)


# --- the books ----------------------------------------------------------------------------------


def ledger_mismatches(soak: Soak, pg) -> tuple[int, list[str]]:
    rows = {
        rid: (status, completion)
        for rid, status, completion in pg.query(
            "SELECT request_id, status, completion_tokens FROM tenants_usagerecord"
        )
    }
    problems = []
    for o in soak.outcomes:
        if o.request_id is None:
            continue
        row = rows.get(o.request_id)
        if o.result == "completed" and (row is None or row != ("success", o.completion_tokens)):
            problems.append(f"{o.kind} {o.request_id}: told {o.completion_tokens}, ledger {row}")
        elif o.result != "completed" and o.started and row is None:
            problems.append(f"{o.kind} {o.request_id}: failed after it started ({o.code}), no ledger row")
    return len(problems), problems


def leaked_reservations(tenant_ids: list[int]) -> int:
    from core.redis_client import get_redis
    from tenants.ratelimit import limiter

    client = get_redis()
    leaked = sum(limiter.in_flight_count(tenant_id=t) for t in tenant_ids)
    for t in tenant_ids:
        leaked += sum(
            1 for _ in client.scan_iter(match=limiter.Keys(tenant_id=t, api_key_id=0).reservation("*"))
        )
    return leaked + int(client.zcard(limiter.open_settlements_key()))


def blocks_in_use() -> int:
    from inference.gateway import replica_stats_list

    stats = replica_stats_list(MODEL)
    return sum(s.num_total_blocks - s.num_free_blocks for s in stats) if stats else -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=180.0, help="seconds between faults")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--rss-window-minutes", type=float, default=20.0)
    args = parser.parse_args()

    from tests.e2e.faults import OwnPostgres

    work = Path(tempfile.mkdtemp(prefix="pagoda-soak-", dir="/tmp"))
    pg = OwnPostgres(free_port())
    soak = Soak(work=work, args=args, ports=[free_port(), free_port()])
    supervisor = None
    try:
        pg.start()
        pg.create_database()
        soak.env = {
            "DATABASE_URL": pg.url,
            "REDIS_URL": f"unix://{work}/redis.sock",
            "PAGODA_REDIS_PREFIX": "pagoda-soak:",
            "PAGODA_VAR_DIR": str(work),
            "PAGODA_MEDIA_DIR": str(work / "media"),
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "PAGODA_ALLOW_DEV_SECRETS": "true",
            "DEBUG": "false",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PAGODA_TENANT_DEFAULT_RPM": "100000",
        }
        os.environ.update(soak.env)
        write_supervisor_conf(soak)
        supervisor = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "supervisord"), "-c", str(soak.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(lambda: (work / "redis.sock").exists() and soak.pid("redis"), timeout=60, what="redis")
        import django

        django.setup()
        import logging

        for noisy in ("httpx", "httpx2"):  # a line per request
            logging.getLogger(noisy).setLevel(logging.WARNING)
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)
        base = model_dir("small")
        [adapter] = make_adapters(base, work / "adapters", 1, rank=8)
        call_command("model_register", name=MODEL, path=str(base), max_model_len=1024, engine_settings=[])

        from tenants.services import api_key_create, tenant_create

        free = tenant_create(name="Soak base", slug="soak-base", allowed_models=[MODEL])
        tuned = tenant_create(name="Soak adapter", slug="soak-adapter", allowed_models=[MODEL])
        _, free_key = api_key_create(tenant=free, name="soak")
        _, tuned_key = api_key_create(tenant=tuned, name="soak")
        soak.ctl("start", "web-1", "web-2", "engine", "celery-worker", "celery-beat")
        for port in soak.ports:
            wait_for(lambda port=port: ready(port), timeout=300, what=f"web on {port} ready")
        upload = subprocess.run(
            [
                "curl",
                "-sf",
                f"http://127.0.0.1:{soak.ports[0]}/v1/adapters",
                "-H",
                f"Authorization: Bearer {tuned_key}",
                "-F",
                "name=soak-tone",
                "-F",
                f"base_model={MODEL}",
                "-F",
                f"file=@{adapter / 'adapter_config.json'}",
                "-F",
                f"file=@{adapter / 'adapter_model.safetensors'}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert upload.returncode == 0, upload.stdout + upload.stderr

        def adapter_ready() -> bool:
            request = urllib.request.Request(
                f"http://127.0.0.1:{soak.ports[0]}/v1/adapters",
                headers={"Authorization": f"Bearer {tuned_key}"},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                return any(a.get("status") == "ready" for a in json.loads(response.read())["data"])

        wait_for(adapter_ready, timeout=300, what="the adapter to be validated")
        print(f"[soak] up: webs {soak.ports}, work dir {work}; {args.minutes} min", flush=True)

        programs = ["redis", "web-1", "web-2", "engine", "celery-worker", "celery-beat"]
        memory_start = redis_memory_mb(work)
        threads = [threading.Thread(target=sample_loop, args=(soak, programs), daemon=True)]
        tenants = [(free_key, MODEL), (tuned_key, "soak-tone")]
        threads += [
            threading.Thread(target=client_loop, args=(soak, i, tenants), daemon=True)
            for i in range(args.clients)
        ]
        threads.append(threading.Thread(target=fault_loop, args=(soak, pg), daemon=True))
        started = time.monotonic()
        for thread in threads:
            thread.start()
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(10)
            with soak.lock:
                tally = Counter(o.result for o in soak.outcomes)
            print(f"[soak] {time.monotonic() - started:.0f}s {dict(tally)}", flush=True)
        soak.stop.set()
        for thread in threads:
            thread.join(timeout=180)

        # Idle: every stream ended, every settlement written.
        tenant_ids = [free.id, tuned.id]
        wait_for(lambda: blocks_in_use() == 0, timeout=120, what="the engine to go idle")
        try:
            wait_for(lambda: leaked_reservations(tenant_ids) == 0, timeout=120, what="the books to close")
        except RuntimeError:
            pass
        mismatches, problems = ledger_mismatches(soak, pg)
        for problem in problems[:20]:
            print(f"[soak] ledger: {problem}", flush=True)
        tally = Counter(o.result for o in soak.outcomes)
        figures = {
            "minutes": args.minutes,
            "faults": Counter(f for _, f in soak.faults),
            "requests": len(soak.outcomes),
            "completed": tally["completed"],
            "clean_errors": tally["clean_error"],
            "resets": tally["reset"],
            "by_kind": {
                k: dict(Counter(o.result for o in soak.outcomes if o.kind == k))
                for k in ("rest", "sse", "ws")
            },
            "ledger_mismatches": mismatches,
            "leaked_reservations": leaked_reservations(tenant_ids),
            "rss_growth_pct": rss_growth(soak, args.rss_window_minutes * 60),
            "redis_used_memory_mb": {"start": memory_start, "end": redis_memory_mb(work)},
            "redis_used_memory_mb_by_minute": list({t // 60: mb for t, mb in soak.redis_mb}.values()),
            "redis_keys_at_end": redis_keys(work, soak.env["PAGODA_REDIS_PREFIX"]),
            "kv_blocks_in_use_at_idle": blocks_in_use(),
        }
        print(json.dumps(figures), flush=True)
        return 0
    finally:
        soak.stop.set()
        if supervisor is not None:
            supervisor.send_signal(signal.SIGTERM)
            try:
                supervisor.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(supervisor.pid, signal.SIGKILL)
        pg.remove()
        if not os.environ.get("PAGODA_SOAK_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
