"""Failures on the serving path with real processes: two engine replicas of one model behind a real
daphne, a short claim timeout, the official `openai` client.

- A replica SIGKILLed mid-stream: its streaming client gets an error event instead of hanging, the
  requests it held but had not started are reclaimed and finished by the other replica, and every
  request is settled once (one ledger row, no reservation left).
- A client that goes away mid-stream: the engine drops the sequence and frees its KV blocks, and
  the ledger bills only the tokens produced.

The tests share one stack and run in file order: the cancel test needs both replicas, the kill
test leaves one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest

from tenants.models import Tenant, UsageRecord
from tests.e2e.settlement import assert_settled, engine_events
from tests.e2e.stack import ServingStack, open_stream, served_world

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

MODEL = "e2e-tiny-failover"
MAX_MODEL_LEN = 2048
CLAIM_TIMEOUT_MS = 1000
MESSAGES = [{"role": "user", "content": "Recite the names of every pagoda you know."}]
PROMPT = "A short note on the bells of the pagoda"
# Longer than any test waits for: a stream of this many tokens is still running when it is cut.
LONG_MAX_TOKENS = 1800
LONG = {"ignore_eos": True}
# Limits high enough never to refuse, set so that every counter admission keeps is exercised.
LIMITS = dict(tokens_per_minute=10**8, max_concurrent_requests=100, monthly_token_quota=10**9)


@dataclass
class World:
    stack: ServingStack
    failover: Tenant
    raw_key_failover: str
    canceller: Tenant
    raw_key_canceller: str


@pytest.fixture(scope="module")
def world(committed_db, e2e_model_dir, tmp_path_factory) -> Iterator[World]:
    # Two tenants of the world, both allowed the model, so each test's ledger is its own.
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["a", "b"],
        model=MODEL,
        model_dir=e2e_model_dir,
        max_model_len=MAX_MODEL_LEN,
        engine_settings={
            "num_blocks": 192,
            # One sequence runs at a time and up to four are held: requests queued behind a
            # running one sit in its replica, unstarted, which is what a kill must not lose.
            "max_num_seqs": 1,
            "max_held": 4,
            "claim_timeout_ms": CLAIM_TIMEOUT_MS,
        },
        tenant_a={"name": "Failover", "slug": "e2e-failover", "allowed_models": [MODEL], **LIMITS},
        tenant_b={"name": "Canceller", "slug": "e2e-canceller", "allowed_models": [MODEL], **LIMITS},
        key_names=("failover-key", "canceller-key"),
    ) as (base, stack):
        yield World(stack, base.tenant_a, base.raw_key_a, base.tenant_b, base.raw_key_b)


def stream_and_hang_up(client: openai.OpenAI, *, chunks: int, while_streaming=None) -> tuple[str, int]:
    """Open a long chat stream, read `chunks` chunks, call `while_streaming`, read one more and close
    the connection. Returns the request id and how many content chunks (one token each) arrived."""
    opened = open_stream(client, model=MODEL, messages=MESSAGES, max_tokens=LONG_MAX_TOKENS, first=chunks)
    stream, iterator, received = opened.stream, opened.chunks, opened.received
    if while_streaming is not None:
        while_streaming()
    received.append(next(iterator))
    stream.close()
    # The first chunk only carries the role.
    return stream.response.headers["x-request-id"], len(received) - 1


def test_clients_that_go_away_mid_stream_free_the_blocks_and_are_billed_for_what_was_produced(world):
    stack = world.stack
    client = stack.client(world.raw_key_canceller)

    def engine_is_busy() -> None:
        # The engine holds the request's blocks while it runs, as its heartbeat shows.
        busy = stack.wait_until(
            lambda: [s for s in stack.replica_stats().values() if s.num_running == 1],
            timeout=10,
            what="a busy heartbeat",
        )
        assert busy[0].num_free_blocks < busy[0].num_total_blocks

    streams = [stream_and_hang_up(client, chunks=4, while_streaming=engine_is_busy)]
    # More clients hanging up at once after a few tokens: every disconnect must abort its request,
    # none may run on to max_tokens.
    streams += [stream_and_hang_up(client, chunks=2) for _ in range(3)]
    closed_at = time.monotonic()

    def all_idle() -> bool:
        stats = stack.replica_stats().values()
        return len(stats) == 2 and all(
            (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks) for s in stats
        )

    stack.wait_until(all_idle, timeout=10, what="every replica to report its blocks free")
    freed_after = time.monotonic() - closed_at
    request_ids = [request_id for request_id, _ in streams]
    stack.wait_until(
        lambda: UsageRecord.objects.filter(request_id__in=request_ids).count() == len(request_ids),
        timeout=10,
        what="the ledger rows",
    )

    # The aborts took a step and a heartbeat or two, not the rest of the generations.
    assert freed_after < 5
    for request_id, content_chunks in streams:
        events = engine_events(request_id)
        produced = sum(len(o["token_ids"]) for e in events if e.type == "delta" for o in e.outputs)
        assert (events[-1].type, [o["finish_reason"] for o in events[-1].outputs]) == ("finished", ["abort"])
        assert events[-1].usage["completion_tokens"] == produced
        row = UsageRecord.objects.get(request_id=request_id)
        assert (row.status, row.model) == ("cancelled", MODEL)
        # Billed for what the server sent: at least what reached the client, never more than the
        # engine produced (a token or two may have been on the wire when the client hung up).
        assert content_chunks <= row.completion_tokens <= produced < LONG_MAX_TOKENS
    assert_settled(world.canceller, request_ids)


def test_a_replica_killed_mid_stream_fails_its_stream_and_its_queued_requests_finish_on_the_other(world):
    stack = world.stack
    client = stack.client(world.raw_key_failover)
    with ThreadPoolExecutor(max_workers=2) as pool:
        with stack.paused("b"):
            # With b frozen, a takes everything: the long stream, then two requests queued behind it.
            stream = client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=LONG_MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body=LONG,
            )
            streamed_id = stream.response.headers["x-request-id"]
            chunks = iter(stream)
            received = [next(chunks) for _ in range(4)]
            queued = [
                pool.submit(
                    client.completions.with_raw_response.create,
                    model=MODEL,
                    prompt=f"{PROMPT} {i}",
                    max_tokens=8,
                    temperature=0,
                    extra_body=LONG,
                )
                for i in range(2)
            ]
            stack.wait_until(
                lambda: stack.holders() == ["a", "a", "a"], timeout=20, what="a to hold all three requests"
            )

        received.append(next(chunks))
        stack.kill("a")
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError) as caught:
            for chunk in chunks:
                received.append(chunk)
        failed_after = time.monotonic() - killed_at
        finished = [future.result(timeout=60) for future in queued]

    # The stream ends with an error event soon after the kill: within the claim timeout plus the
    # survivor's reclaim interval and a step, not after a client timeout.
    assert caught.value.code == "engine_failed"
    assert "stopped" in caught.value.message
    assert failed_after < 10
    for raw in finished:
        completion = raw.parse()
        assert (completion.choices[0].finish_reason, completion.usage.completion_tokens) == ("length", 8)
        assert engine_events(raw.headers["x-request-id"])[-1].replica == "b"
    assert stack.holders() == []

    queued_ids = [raw.headers["x-request-id"] for raw in finished]
    rows = {r.request_id: r for r in UsageRecord.objects.filter(tenant=world.failover)}
    assert rows[streamed_id].status == "error"
    # Billed for what the client was sent: one token per content chunk.
    assert rows[streamed_id].completion_tokens == len(received) - 1
    assert [(rows[rid].status, rows[rid].completion_tokens) for rid in queued_ids] == [("success", 8)] * 2
    assert_settled(world.failover, [streamed_id, *queued_ids])
    # Once a's heartbeat expires, readiness lists b alone, and still ready.
    stack.wait_until(
        lambda: [r["replica_id"] for r in stack.ready()[1]["models"][MODEL]["replicas"]] == ["b"],
        timeout=15,
        what="a to drop out of /ready",
    )
    assert stack.ready()[0] == 200
