"""PostgreSQL stopped mid-stream and started again, on a cluster of the test's own (initdb in a temp
directory), never the shared server: the running stream completes (the engines and Redis need no
database), new API requests get an OpenAI-shaped 503 with Retry-After and /ready says not_ready,
the finished request's settlement waits in Redis, and its one ledger row is written once the
database is back. Then the platform serves new requests again, with no restart.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from core.redis_client import get_redis
from tenants.ratelimit import limiter
from tests.e2e.faults import OwnPostgres
from tests.e2e.processes import ROOT, free_port, server_env
from tests.e2e.stack import ServingStack, open_stream, serving_stack
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "e2e-tiny-pg-outage"
MESSAGES = [{"role": "user", "content": "Recite the names of every pagoda you know."}]


@dataclass
class World:
    stack: ServingStack
    pg: OwnPostgres
    raw_key: str
    tenant_id: int


def _manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=server_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def world(e2e_model_dir, tmp_path_factory) -> Iterator[World]:
    pg = OwnPostgres(free_port())
    try:
        pg.start()
        pg.create_database()
        env = {"DATABASE_URL": pg.url, "PAGODA_SETTLER_SWEEP_S": "1"}
        _manage(env, "migrate", "--noinput")
        _manage(
            env,
            "model_register",
            "--name",
            MODEL,
            "--path",
            str(e2e_model_dir),
            "--max-model-len",
            "2048",
            *("--engine-setting", "device=cpu", "--engine-setting", "num_blocks=256"),
        )
        demo = json.loads(
            _manage(env, "create_demo_tenant", "--slug", "pg-outage", "--models", MODEL, "--json")
        )
        [(tenant_id,)] = pg.query("SELECT id FROM tenants_tenant WHERE slug = %s", "pg-outage")
        logs = tmp_path_factory.mktemp("e2e-pg-outage-logs")
        with serving_stack(model=MODEL, replica_ids=["a"], log_dir=logs, env=env) as stack:
            yield World(stack, pg, demo["api_key"], tenant_id)
    finally:
        pg.remove()


def _ledger(pg: OwnPostgres, request_id: str) -> list[tuple]:
    return pg.query(
        "SELECT status, prompt_tokens, completion_tokens FROM tenants_usagerecord WHERE request_id = %s",
        request_id,
    )


def test_a_database_outage_mid_stream_loses_no_billing_and_ends_without_a_restart(world):
    stack, pg = world.stack, world.pg
    client = stack.client(world.raw_key, timeout=120)
    max_tokens = 400
    opened = open_stream(client, model=MODEL, messages=MESSAGES, max_tokens=max_tokens, include_usage=True)
    request_id, chunks = opened.request_id, opened.chunks
    received = [next(chunks) for _ in range(5)]
    pg.stop()
    received += list(chunks)
    assert received[-1].usage.completion_tokens == max_tokens

    # While the database is down: an OpenAI-shaped 503 that says when to retry, and not ready.
    stack.assert_refusing(client, down="database")

    # Settled in Redis (slot and reserved tokens released); its row waits for the database.
    keys = limiter.Keys(tenant_id=world.tenant_id, api_key_id=0)
    wait_until(
        lambda: limiter.in_flight_count(tenant_id=world.tenant_id) == 0,
        timeout=30,
        what="the slot to be freed",
    )
    assert get_redis().hget(keys.reservation(request_id), "final") is not None

    pg.start()
    rows = wait_until(lambda: _ledger(pg, request_id), timeout=60, what="the ledger row")
    assert rows == [("success", rows[0][1], max_tokens)]
    wait_until(
        lambda: not get_redis().exists(keys.reservation(request_id)), timeout=10, what="the reservation to go"
    )

    # Serving again, with no restart: the pool replaced the connections the restart broke.
    def serves() -> bool:
        try:
            reply = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0
            )
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            return False
        return reply.usage.completion_tokens == 4

    wait_until(serves, timeout=60, interval=1, what="a new request to be served")
    assert stack.ready()[0] == 200
    assert len(_ledger(pg, request_id)) == 1
    assert limiter.in_flight_count(tenant_id=world.tenant_id) == 0
