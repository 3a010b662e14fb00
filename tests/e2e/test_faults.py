"""Faults of the platform's own parts, with real processes on a redis-server of the test's own:
an engine replica, two web processes (daphne through config.web_server), the official client.

- A web process SIGKILLed mid-stream: the other web process's settler bills the request from what
  the engine recorded, cancels its generation (nobody reads it), and frees its reservation.
- Redis restarted mid-stream (SIGTERM, as a supervisor or an operator restarts it; it keeps its
  data in its append-only file): the stream completes with every token once, and is billed once.
  Crashed (SIGKILL): the stream completes, or ends with stream_interrupted, billed what was sent.
- Redis down for a while: new requests get a 503 with Retry-After, /ready says not_ready, no
  process exits (each logs the outage once), and a running stream waits and then completes.

After each: the ledger has exactly one row per request, with the tokens produced; the tenant's
concurrency and reserved tokens are back to zero; and the platform serves a new request.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from django.conf import settings

from core.redis_client import get_redis
from engine.protocol import cancel_request_id, cancel_stream
from tenants.models import Tenant, UsageRecord
from tests.e2e.faults import OwnRedis, own_redis_settings
from tests.e2e.settlement import assert_settled, engine_events
from tests.e2e.stack import Process, ServingStack, open_stream, served_world, start_web

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

MODEL = "e2e-tiny-faults"
MESSAGES = [{"role": "user", "content": "Recite the names of every pagoda you know."}]
LONG_MAX_TOKENS = 1800
LIMITS = dict(tokens_per_minute=10**8, max_concurrent_requests=100, monthly_token_quota=10**9)
# A dead web process is noticed within 2 s and swept every second, well inside the time the tiny
# model takes to write LONG_MAX_TOKENS.
SETTLER_ENV = {"PAGODA_OWNER_TTL_S": "2", "PAGODA_SETTLER_SWEEP_S": "1"}


@dataclass
class World:
    stack: ServingStack
    redis: OwnRedis
    second_web: Process
    second_url: str
    tenant: Tenant
    raw_key: str


@pytest.fixture(scope="module")
def world(committed_db, e2e_model_dir, tmp_path_factory) -> Iterator[World]:
    own = OwnRedis(tmp_path_factory.mktemp("e2e-faults-redis"))
    own.start()
    logs = tmp_path_factory.mktemp("e2e-faults-logs")
    try:
        with own_redis_settings(own):
            with served_world(
                committed_db,
                tmp_path_factory,
                replica_ids=["a"],
                env=SETTLER_ENV,
                model=MODEL,
                model_dir=e2e_model_dir,
                engine_settings={
                    "num_blocks": 512,
                    "max_num_seqs": 4,
                    "claim_timeout_ms": 1000,
                },
                tenant_a={"name": "Faults", "slug": "e2e-faults", "allowed_models": [MODEL], **LIMITS},
            ) as (base, stack):
                second, second_url = start_web(log_path=logs / "web-2.log", name="web 2", **SETTLER_ENV)
                try:
                    yield World(stack, own, second, second_url, base.tenant_a, base.raw_key_a)
                finally:
                    if second.popen.poll() is None:
                        second.popen.kill()
                        second.popen.wait(timeout=30)
    finally:
        if own.process is not None:
            own.stop(signal.SIGKILL)


def _client(base_url: str, raw_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=raw_key, max_retries=0, timeout=120)


def _open_stream(client: openai.OpenAI, *, max_tokens: int, first: int, include_usage: bool = False):
    opened = open_stream(
        client,
        model=MODEL,
        messages=MESSAGES,
        max_tokens=max_tokens,
        first=first,
        include_usage=include_usage,
    )
    return opened.request_id, opened.chunks, opened.received


def _produced(request_id: str) -> tuple[int, list[str]]:
    events = engine_events(request_id)
    produced = sum(len(o["token_ids"]) for e in events if e.type == "delta" for o in e.outputs)
    last = events[-1] if events and events[-1].type != "delta" else None
    reasons = [o["finish_reason"] for o in last.outputs] if last is not None else []
    return produced, reasons


def _serves_a_new_request(world: World) -> None:
    reply = _client(world.stack.base_url, world.raw_key).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens == 4


def test_a_web_process_killed_mid_stream_is_billed_by_a_settler_and_its_generation_is_aborted(world):
    stack = world.stack
    request_id, chunks, received = _open_stream(
        _client(world.second_url, world.raw_key), max_tokens=LONG_MAX_TOKENS, first=20
    )
    world.second_web.popen.send_signal(signal.SIGKILL)
    world.second_web.popen.wait(timeout=30)
    killed_at = time.monotonic()
    # The engine is frozen until the settler has cancelled the stream nobody reads: the tiny model
    # could otherwise write all its tokens before the owner key lapses.
    with stack.paused("a", settle_ms=0):
        stack.wait_until(
            lambda: (
                request_id
                in [
                    cancel_request_id(f)
                    for _, f in get_redis().xrange(cancel_stream(settings.REDIS_PREFIX, MODEL))
                ]
            ),
            timeout=60,
            what="the settler to cancel the abandoned request",
        )

    row = stack.wait_until(
        lambda: UsageRecord.objects.filter(request_id=request_id).first(),
        timeout=120,
        what="the ledger row of the killed web process's request",
    )
    billed_after = time.monotonic() - killed_at
    produced, reasons = _produced(request_id)
    # The engine's own count, which the usage record carried: at least what reached the client.
    assert (row.prompt_tokens, row.completion_tokens) == (
        engine_events(request_id)[-1].usage["prompt_tokens"],
        produced,
    )
    assert row.completion_tokens >= len(received) - 1
    # Nobody read the stream any more: the settler cancelled it before it ran to max_tokens.
    assert reasons == ["abort"] and produced < LONG_MAX_TOKENS
    assert row.status == "cancelled"
    assert_settled(world.tenant, [request_id])
    stack.wait_until(
        lambda: all(
            (s.num_running, s.num_free_blocks) == (0, s.num_total_blocks)
            for s in stack.replica_stats().values()
        ),
        timeout=15,
        what="the engine to free the aborted request's blocks",
    )
    # Within the owner key's lapse, a sweep or two, and the abort's step.
    assert billed_after < 60
    _serves_a_new_request(world)


def test_a_stream_across_a_redis_restart_completes_with_every_token_once(world):
    stack = world.stack
    before = set(UsageRecord.objects.filter(tenant=world.tenant).values_list("request_id", flat=True))
    max_tokens = 600
    request_id, chunks, received = _open_stream(
        _client(stack.base_url, world.raw_key), max_tokens=max_tokens, first=10, include_usage=True
    )
    down_s = world.redis.restart(signal.SIGTERM)
    received += list(chunks)

    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    finish = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
    usage = received[-1].usage
    assert down_s < 5
    assert finish == ["length"]
    assert usage.completion_tokens == max_tokens
    # Every token once: the text is the one the engine streamed, entry by entry, in order.
    events = engine_events(request_id)
    assert text == "".join(o["text"] for e in events if e.type == "delta" for o in e.outputs)
    assert sum(len(o["token_ids"]) for e in events if e.type == "delta" for o in e.outputs) == max_tokens
    row = stack.wait_until(
        lambda: UsageRecord.objects.filter(request_id=request_id).first(), timeout=30, what="the ledger row"
    )
    assert (row.status, row.completion_tokens) == ("success", max_tokens)
    assert_settled(world.tenant, sorted(before | {request_id}))
    _serves_a_new_request(world)


def test_a_stream_across_a_redis_crash_completes_or_ends_cleanly_and_is_billed_what_was_sent(world):
    """SIGKILL: Redis may come back without its last second of writes. A stream whose reader had
    already read every lost entry goes on; one that would miss text ends with stream_interrupted."""
    stack = world.stack
    before = set(UsageRecord.objects.filter(tenant=world.tenant).values_list("request_id", flat=True))
    max_tokens = 600
    request_id, chunks, received = _open_stream(
        _client(stack.base_url, world.raw_key), max_tokens=max_tokens, first=10
    )
    world.redis.restart(signal.SIGKILL)
    error = None
    try:
        received += list(chunks)
    except openai.APIError as exc:
        error = exc
    row = stack.wait_until(
        lambda: UsageRecord.objects.filter(request_id=request_id).first(), timeout=30, what="the ledger row"
    )
    if error is None:
        finish = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
        assert (row.status, row.completion_tokens) == ("success", max_tokens)
    else:
        assert error.code == "stream_interrupted", error
        # Billed for what the client was sent: one token per content chunk (the first carries the role).
        assert (row.status, row.completion_tokens) == ("error", len(received) - 1)
    assert_settled(world.tenant, sorted(before | {request_id}))
    _serves_a_new_request(world)


def test_while_redis_is_down_new_requests_get_a_503_nothing_exits_and_a_running_stream_waits(world):
    stack = world.stack
    before = set(UsageRecord.objects.filter(tenant=world.tenant).values_list("request_id", flat=True))
    client = _client(stack.base_url, world.raw_key)
    max_tokens = 600
    request_id, chunks, received = _open_stream(client, max_tokens=max_tokens, first=10, include_usage=True)
    engine_log = stack.replicas["a"].log_path
    lost_before = engine_log.read_text().count("lost the connection to Redis")
    world.redis.stop()
    try:
        stack.assert_refusing(client, down="redis")
        stack.wait_until(
            lambda: engine_log.read_text().count("lost the connection to Redis") > lost_before,
            timeout=30,
            what="the engine to notice the outage",
        )
        # Every process rides it out (the killed second web process of the first test aside).
        assert [stack.web.popen.poll(), stack.replicas["a"].popen.poll()] == [None, None]
    finally:
        world.redis.start()
    received += list(chunks)

    # The engine kept the sequence: the stream completes, every token once, billed once.
    assert received[-1].usage.completion_tokens == max_tokens
    events = engine_events(request_id)
    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert text == "".join(o["text"] for e in events if e.type == "delta" for o in e.outputs)
    row = stack.wait_until(
        lambda: UsageRecord.objects.filter(request_id=request_id).first(), timeout=30, what="the ledger row"
    )
    assert (row.status, row.completion_tokens) == ("success", max_tokens)
    assert_settled(world.tenant, sorted(before | {request_id}))
    # One line when the connection went, one when it came back: not one per retry.
    log = engine_log.read_text()
    assert log.count("lost the connection to Redis") == lost_before + 1
    assert log.count("Redis answers again") == lost_before + 1
    _serves_a_new_request(world)
