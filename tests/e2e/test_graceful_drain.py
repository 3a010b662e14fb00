"""Graceful drain with real processes: two engine replicas of one model behind the web entry point
(`python -m config.web_server`), the official `openai` client.

- An engine replica SIGTERMed under load hands the requests it had not started back to the model's
  stream at once (the claim timeout here is ten minutes: only the hand-back can move them), the
  other replica answers them, the replica finishes what it runs and exits 0; nothing is lost or
  failed and every request is settled once.
- A web process SIGTERMed with a stream open stops listening, says not_ready on a connection it
  already had, finishes the stream and exits 0.

The tests share one stack and run in file order: the engine drain leaves replica b alone.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from django.conf import settings

from core.redis_client import get_redis
from engine.protocol import CONSUMER_GROUP, GenerateRequest
from engine.worker.queue import model_request_streams
from inference.gateway.queue_depth import queue_depth
from tenants.models import Tenant, UsageRecord
from tests.e2e.processes import E2E_METRICS_TOKEN
from tests.e2e.settlement import assert_settled, engine_events
from tests.e2e.stack import ServingStack, served_world, start_web

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

MODEL = "e2e-tiny-drain"
MAX_MODEL_LEN = 2048
DRAIN_GRACE_S = 60
MESSAGES = [{"role": "user", "content": "Describe the five roofs of the pagoda, one by one."}]
# The two requests the drained replica is running when the signal comes: as long as the context
# allows, so that they still run in the moments the replica is not frozen before the signal (on a
# fast machine the tiny model writes a thousand tokens in under a second), and short enough to
# finish well within the grace period.
LONG_MAX_TOKENS = 1900
SHORT_MAX_TOKENS = 24
NUM_SHORT = 12
LONG = {"ignore_eos": True}
LIMITS = dict(tokens_per_minute=10**8, max_concurrent_requests=100, monthly_token_quota=10**9)


@dataclass
class World:
    stack: ServingStack
    loaded: Tenant
    raw_key_loaded: str
    streamer: Tenant
    raw_key_streamer: str


@pytest.fixture(scope="module")
def world(committed_db, e2e_model_dir, tmp_path_factory) -> Iterator[World]:
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["a", "b"],
        model=MODEL,
        model_dir=e2e_model_dir,
        max_model_len=MAX_MODEL_LEN,
        engine_settings={
            "num_blocks": 256,
            # Two sequences run at a time and six are held: a replica holds running and
            # waiting requests at once, which is what a drain must tell apart.
            "max_num_seqs": 2,
            "max_held": 6,
            # Far beyond the test: a request moves to another replica by hand-back alone.
            "claim_timeout_ms": 600_000,
            "drain_grace_s": DRAIN_GRACE_S,
        },
        tenant_a={"name": "Loaded", "slug": "e2e-loaded", "allowed_models": [MODEL], **LIMITS},
        tenant_b={"name": "Streamer", "slug": "e2e-streamer", "allowed_models": [MODEL], **LIMITS},
        key_names=("loaded-key", "streamer-key"),
    ) as (base, stack):
        yield World(stack, base.tenant_a, base.raw_key_a, base.tenant_b, base.raw_key_b)


def held_request_ids(replica_id: str) -> set[str]:
    """The engine request ids of the entries `replica_id` holds (taken, not acked)."""
    redis = get_redis()
    ids = set()
    for stream in model_request_streams(redis, settings.REDIS_PREFIX, MODEL):
        try:
            rows = redis.xpending_range(stream, CONSUMER_GROUP, "-", "+", 100, consumername=replica_id)
        except Exception:  # a replica's stream retired between the two reads
            continue
        for row in rows:
            # Empty when the entry was handed back (and deleted) between the two reads: no longer held.
            for _, fields in redis.xrange(stream, row["message_id"], row["message_id"]):
                ids.add(GenerateRequest.decode(fields).request_id)
    return ids


def answered_by(request_id: str) -> set[str]:
    """Every replica named in the request's output stream (the first delta and the end carry it)."""
    return {event.replica for event in engine_events(request_id) if event.replica}


def stream_chat(client: openai.OpenAI, max_tokens: int) -> dict[str, Any]:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    chunks = list(stream)
    return {
        "request_id": stream.response.headers["x-request-id"],
        "finish_reason": next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices),
        "completion_tokens": chunks[-1].usage.completion_tokens,
    }


def complete(client: openai.OpenAI, i: int) -> dict[str, Any]:
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=f"The bell of pagoda number {i} rings",
        max_tokens=SHORT_MAX_TOKENS,
        temperature=0,
        extra_body=LONG,
    )
    completion = raw.parse()
    return {
        "request_id": raw.headers["x-request-id"],
        "finish_reason": completion.choices[0].finish_reason,
        "completion_tokens": completion.usage.completion_tokens,
    }


def test_a_replica_drained_under_load_hands_back_what_it_had_not_started_and_loses_nothing(world):
    stack = world.stack
    client = stack.client(world.raw_key_loaded, timeout=180)
    replica_a = stack.replicas["a"].popen
    with ThreadPoolExecutor(max_workers=2 + NUM_SHORT) as pool:
        with stack.paused("b"):
            # With b frozen, a takes everything it may hold: two long streams that run, then four
            # of the short requests that wait behind them; the other eight stay in the stream.
            running = [pool.submit(stream_chat, client, LONG_MAX_TOKENS) for _ in range(2)]
            stack.wait_until(
                lambda: (
                    len(held_request_ids("a")) == 2
                    and all(answered_by(rid) == {"a"} for rid in held_request_ids("a"))
                ),
                timeout=60,
                what="a to stream both long requests",
            )
            started = held_request_ids("a")
            # a is frozen while the short requests are queued, so its two streams do not run on
            # for as long as that takes; it takes four of them as soon as it runs again.
            replica_a.send_signal(signal.SIGSTOP)
            try:
                shorts = [
                    pool.submit(stream_chat, client, SHORT_MAX_TOKENS)
                    if i % 2
                    else pool.submit(complete, client, i)
                    for i in range(NUM_SHORT)
                ]
                stack.wait_until(
                    lambda: queue_depth(MODEL).waiting == NUM_SHORT,
                    timeout=60,
                    what="the short requests to be queued",
                )
            finally:
                replica_a.send_signal(signal.SIGCONT)
            stack.wait_until(
                lambda: len(held_request_ids("a")) == 6, timeout=60, what="a to hold six", interval=0.02
            )
            waiting = held_request_ids("a") - started
            assert all(engine_events(rid) == [] for rid in waiting)

            replica_a.send_signal(signal.SIGTERM)

            # Handed back at once: with b frozen and a claim timeout of ten minutes, nothing else
            # could take them from a.
            stack.wait_until(
                lambda: held_request_ids("a") == started, timeout=30, what="a to hand back what waited"
            )
            stats = stack.replica_stats()["a"]
            assert (stats.draining, stats.num_running) == (True, 2)
            _, body = stack.ready()
            assert [r["draining"] for r in body["models"][MODEL]["replicas"] if r["replica_id"] == "a"] == [
                True
            ]

        results = [future.result(timeout=180) for future in [*running, *shorts]]
        returncode = replica_a.wait(timeout=DRAIN_GRACE_S)

    # a ran out its two streams and left cleanly, before its grace period was over.
    assert returncode == 0, stack.replicas["a"].tail()
    expected = [LONG_MAX_TOKENS] * 2 + [SHORT_MAX_TOKENS] * NUM_SHORT
    assert [(r["finish_reason"], r["completion_tokens"]) for r in results] == [
        ("length", n) for n in expected
    ]
    request_ids = [r["request_id"] for r in results]
    assert started == set(request_ids[:2])
    assert len(waiting) == 4
    # Every request was answered by one replica only: those a had started by a, the ones it
    # handed back by b, as were the ones it never took.
    assert {rid: answered_by(rid) for rid in request_ids} == {
        rid: {"a"} if rid in started else {"b"} for rid in request_ids
    }
    assert stack.holders() == []
    rows = UsageRecord.objects.filter(tenant=world.loaded)
    assert sorted(rows.values_list("request_id", "status", "completion_tokens")) == sorted(
        (rid, "success", n) for rid, n in zip(request_ids, expected, strict=True)
    )
    assert_settled(world.loaded, request_ids)


def test_a_web_process_drained_with_a_stream_open_finishes_it_and_takes_no_new_connection(world, tmp_path):
    stack = world.stack
    web, base_url = start_web(
        log_path=tmp_path / "web-drained.log", name="drained web", PAGODA_WEB_DRAIN_GRACE_S="60"
    )
    port = int(base_url.rsplit(":", 1)[1])
    try:
        # A connection opened before the signal and kept alive: where a probe can still ask /ready.
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        kept.request("GET", "/live")
        assert kept.getresponse().read() == b'{"status": "ok"}'
        client = openai.OpenAI(
            base_url=base_url + "/v1", api_key=world.raw_key_streamer, max_retries=0, timeout=180
        )
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=600,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=LONG,
        )
        chunks = iter(stream)
        received = [next(chunks) for _ in range(3)]

        web.popen.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            except ConnectionRefusedError:
                return True
            return False

        stack.wait_until(refused, timeout=30, what="the web process to stop listening")
        kept.request("GET", "/ready", headers={"Authorization": f"Bearer {E2E_METRICS_TOKEN}"})
        ready = kept.getresponse()
        body = json.loads(ready.read())
        received.extend(chunks)
        returncode = web.popen.wait(timeout=60)
    finally:
        if web.popen.poll() is None:
            web.popen.kill()
            web.popen.wait(timeout=30)

    assert (ready.status, body["status"]) == (503, "not_ready")
    assert body["checks"]["web"].startswith("draining")
    assert ready.getheader("connection") == "close"
    # The stream ran to its end as if nothing happened: every token, the usage chunk, [DONE].
    assert [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert received[-1].usage.completion_tokens == 600
    assert returncode == 0, web.tail()
    request_id = stream.response.headers["x-request-id"]
    row = UsageRecord.objects.get(request_id=request_id)
    assert (row.status, row.completion_tokens) == ("success", 600)
    assert_settled(world.streamer, [request_id])


def test_a_websocket_still_open_when_the_web_grace_period_ends_is_closed_and_the_process_exits_zero(
    world, tmp_path
):
    import websocket

    web, base_url = start_web(
        log_path=tmp_path / "web-hurried.log", name="hurried web", PAGODA_WEB_DRAIN_GRACE_S="1"
    )
    try:
        ws = websocket.create_connection(
            base_url.replace("http://", "ws://", 1) + "/ws/v1/chat",
            subprotocols=["pagoda.v1", f"pagoda.bearer.{world.raw_key_streamer}"],
            timeout=60,
        )
        # Authenticated and idle: nothing of its own would ever close it.
        assert json.loads(ws.recv()) == {"type": "authenticated"}

        web.popen.send_signal(signal.SIGTERM)
        opcode, data = ws.recv_data(control_frame=True)
        returncode = web.popen.wait(timeout=60)
    finally:
        if web.popen.poll() is None:
            web.popen.kill()
            web.popen.wait(timeout=30)

    assert (opcode, int.from_bytes(data[:2], "big")) == (websocket.ABNF.OPCODE_CLOSE, 4503)
    assert returncode == 0, web.tail()
    assert "drain grace period over with 1 connections open" in web.tail()


def test_the_web_process_queues_a_burst_of_connections_instead_of_dropping_them(tmp_path):
    import subprocess

    from config.web_server import DEFAULT_BACKLOG

    web, base_url = start_web(log_path=tmp_path / "web-backlog.log", name="web-backlog")
    try:
        port = int(base_url.rsplit(":", 1)[1])
        # For a listening socket, ss's Send-Q is its accept backlog (Twisted's default is 50).
        listening = subprocess.run(
            ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        somaxconn = int(open("/proc/sys/net/core/somaxconn").read())  # noqa: SIM115 - read at once
        assert int(listening[2]) == min(DEFAULT_BACKLOG, somaxconn)
        # And a burst of clients at once: every connection is accepted and answered.
        with ThreadPoolExecutor(max_workers=200) as pool:
            statuses = list(pool.map(lambda _: _live_status(port), range(400)))
        assert statuses == [200] * 400
    finally:
        web.stop()


def _live_status(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", "/live")
        return connection.getresponse().status
    finally:
        connection.close()
