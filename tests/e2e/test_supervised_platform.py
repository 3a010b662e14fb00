"""`scripts/up.sh` as a new user runs it (zero-config: SQLite and the embedded Redis, in a var
directory of the test's own; the random-weight demo model), with its processes under supervision:

- the engine SIGKILLed mid-stream: the supervisor starts the engine again, the new engine takes
  the stream over and finishes it (the client sees one stream, with the text of an undisturbed
  greedy run), billed once, and the platform serves new requests, with no one restarting anything;
- the embedded Redis SIGKILLed: it is started again, and the platform serves, while the web
  process and Celery ride it out (the supervisor had to start nothing else);
- Ctrl-C (SIGINT to the process group) stops every process.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
from pathlib import Path

import openai
import pytest

from tests.e2e.processes import ROOT, free_port
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Recite the names of every pagoda you know."}]
# Long enough to be running at the kill; the restarted engine finishes it.
STREAM_TOKENS = 400


def _supervisorctl(conf: Path, *args: str) -> str:
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "supervisorctl"), "-c", str(conf), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout


def _ledger(var: Path, request_id: str) -> list[tuple]:
    with sqlite3.connect(var / "db.sqlite3") as db:
        return db.execute(
            "SELECT status, completion_tokens FROM tenants_usagerecord WHERE request_id = ?", (request_id,)
        ).fetchall()


def test_up_sh_restarts_what_dies_and_ctrl_c_stops_everything(tmp_path):
    var = tmp_path / "var"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "OMP_NUM_THREADS")}
    env.update(
        PAGODA_VAR_DIR=str(var),
        PAGODA_DEMO_MODEL="random",
        PAGODA_DEMO_MODEL_DIR=str(tmp_path / "model"),
        PORT=str(port),
        OMP_NUM_THREADS="1",
        PAGODA_OWNER_TTL_S="3",
        PAGODA_SETTLER_SWEEP_S="1",
    )
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            ["bash", "scripts/up.sh"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    conf = var / "supervisord.conf"

    def log_text() -> str:
        return log_path.read_text(errors="replace")

    try:

        def started() -> str | None:
            if up.poll() is not None:
                raise AssertionError(f"up.sh exited with {up.returncode}:\n{log_text()[-3000:]}")
            text = log_text()
            match = re.search(r"api_key: (sk-\S+)", text)
            return match.group(1) if match and "Press Ctrl-C" in text else None

        key = wait_until(started, timeout=600, interval=0.5, what="up.sh to start the platform")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)

        def serves() -> bool:
            try:
                reply = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4)
            except (openai.APIStatusError, openai.APIConnectionError):
                return False
            return reply.usage.completion_tokens == 4

        wait_until(serves, timeout=60, interval=0.5, what="the first request to be served")

        # The engine killed mid-stream: its stream waits for the engine to be back, and goes on.
        stream = client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        request_id = stream.response.headers["x-request-id"]
        chunks = iter(stream)
        received = [next(chunks) for _ in range(5)]
        engine_pid = int(_supervisorctl(conf, "pid", "engine").strip())
        os.kill(engine_pid, signal.SIGKILL)
        received.extend(chunks)  # no error: the restarted engine continues it
        assert int(_supervisorctl(conf, "pid", "engine").strip()) != engine_pid
        supervisor_log = (var / "supervisord.log").read_text()
        assert "exited: engine (terminated by SIGKILL; not expected)" in supervisor_log
        assert supervisor_log.count("spawned: 'engine'") == 2
        undisturbed = client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            max_tokens=STREAM_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in received[1:])
            == undisturbed.choices[0].message.content
        )
        # One row, billed for every token once.
        rows = wait_until(lambda: _ledger(var, request_id), timeout=30, what="the ledger row")
        assert rows == [("success", STREAM_TOKENS)]

        # The embedded Redis killed: started again, and the platform serves.
        redis_pid = int(_supervisorctl(conf, "pid", "redis").strip())
        os.kill(redis_pid, signal.SIGKILL)
        wait_until(
            lambda: _supervisorctl(conf, "pid", "redis").strip() not in ("", "0", str(redis_pid)),
            timeout=60,
            what="redis to be started again",
        )
        wait_until(serves, timeout=60, interval=0.5, what="a new request after the Redis restart")
        assert "Traceback" not in log_text()
        # Only what was killed was started again: the others rode out the engine's and Redis's deaths.
        supervisor_log = (var / "supervisord.log").read_text()
        for program in ("web", "celery-worker", "celery-batches", "celery-beat"):
            assert supervisor_log.count(f"spawned: '{program}'") == 1, program
        assert supervisor_log.count("spawned: 'redis'") == 2
    finally:
        # Ctrl-C: SIGINT to the whole process group, as a terminal sends it.
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(timeout=30)
            raise
    # Everything stopped: nothing is left that the run started.
    leftover = subprocess.run(["pgrep", "-f", str(var)], capture_output=True, text=True).stdout.split()
    assert leftover == []
