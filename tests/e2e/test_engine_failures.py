"""Failures on the serving path with real processes: two engine replicas of one model behind a real
daphne, the official `openai` client.

- A client that goes away mid-stream: the engine drops the sequence and frees its KV blocks, and
  the ledger bills only the tokens produced.
- A replica SIGKILLed mid-stream: the other replica takes its requests over once its heartbeat
  lapses (the claim timeout is far longer, so nothing else can explain it). The streaming client
  sees one uninterrupted stream whose text is the undisturbed run's (greedy decoding on this
  engine continues with the same tokens), over SSE and over the websocket, with a json_schema
  response format and with a stop string; the requests it held unstarted finish on the other
  replica, and every request is settled once (one ledger row, no reservation left).

The tests share one stack and run in file order; each kill test starts the killed replica again.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jsonschema
import openai
import pytest

from tenants.models import Tenant, UsageRecord
from tests.e2e.processes import start_engine
from tests.e2e.settlement import assert_settled, engine_events
from tests.e2e.stack import ServingStack, open_stream, served_world

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

MODEL = "e2e-tiny-failover"
MAX_MODEL_LEN = 2048
# Far beyond any test: a request changes replica only because its replica's heartbeat lapsed.
CLAIM_TIMEOUT_MS = 600_000
MESSAGES = [{"role": "user", "content": "Recite the names of every pagoda you know."}]
PROMPT = "A short note on the bells of the pagoda"
# Longer than any test waits for: a stream of this many tokens is still running when it is cut.
LONG_MAX_TOKENS = 1800
# A stream killed after its first chunks: still running at the kill, short enough to finish after.
# The tiny model's single-sequence decode is fast (each layer one C call on CPU): 600 tokens were
# seen to end before two requests queued behind the stream reached its replica on a loaded CI
# machine, so the stream is long enough to outlast that with a wide margin.
FAILOVER_MAX_TOKENS = 1500
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
            # A busy heartbeat is seen within a fifth of a second: a stream that waits for one
            # is far from its LONG_MAX_TOKENS when it is cut (the tiny model decodes over 1,000
            # tokens a second; one beat a second let a stream run to its end on a loaded machine).
            "heartbeat_interval": 0.2,
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


@contextlib.contextmanager
def held_by(stack: ServingStack, replica_id: str) -> Iterator[None]:
    """The requests started in the block go to `replica_id`: the others are paused meanwhile."""
    with contextlib.ExitStack() as paused:
        for other in stack.replicas:
            if other != replica_id:
                paused.enter_context(stack.paused(other))
        yield


def restart(stack: ServingStack, replica_id: str) -> None:
    """Start a killed replica again under the same id, as a supervisor would, and wait for both."""
    old = stack.replicas[replica_id]
    stack.replicas[replica_id] = start_engine(
        model=MODEL, replica_id=replica_id, log_path=old.log_path.with_suffix(f".{time.monotonic_ns()}.log")
    )
    stack.wait_until(
        lambda: sorted(r["replica_id"] for r in stack.ready()[1]["models"][MODEL]["replicas"]) == ["a", "b"],
        timeout=120,
        what="both replicas ready",
    )


def took_over(request_id: str) -> list[str | None]:
    """The replicas that took a request over, as its output stream's failover markers say."""
    return [e.replica for e in engine_events(request_id) if e.type == "failover"]


def chat_stream(client: openai.OpenAI, **body):
    body = {"max_tokens": FAILOVER_MAX_TOKENS, **body}
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **body,
    )


def test_a_replica_killed_mid_stream_is_taken_over_and_the_client_gets_the_undisturbed_text(world):
    stack = world.stack
    client = stack.client(world.raw_key_failover)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=FAILOVER_MAX_TOKENS, temperature=0, extra_body=LONG
    )
    undisturbed, undisturbed_id = raw.parse(), raw.headers["x-request-id"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        with held_by(stack, "a"):
            # a takes everything: the long stream, then two requests queued behind it.
            stream = chat_stream(client, extra_body=LONG)
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
        received.extend(chunks)  # to its end: no error
        finished = [future.result(timeout=60) for future in queued]

    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert text == undisturbed.choices[0].message.content
    assert [c.choices[0].finish_reason for c in received if c.choices][-1] == "length"
    usage = received[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        undisturbed.usage.prompt_tokens,
        FAILOVER_MAX_TOKENS,
    )
    assert took_over(streamed_id) == ["b"]
    for raw in finished:
        completion = raw.parse()
        assert (completion.choices[0].finish_reason, completion.usage.completion_tokens) == ("length", 8)
        assert engine_events(raw.headers["x-request-id"])[-1].replica == "b"

    queued_ids = [raw.headers["x-request-id"] for raw in finished]
    rows = {r.request_id: r for r in UsageRecord.objects.filter(tenant=world.failover)}
    assert (
        rows[streamed_id].status,
        rows[streamed_id].prompt_tokens,
        rows[streamed_id].completion_tokens,
    ) == (
        "success",
        undisturbed.usage.prompt_tokens,
        FAILOVER_MAX_TOKENS,
    )
    assert [(rows[rid].status, rows[rid].completion_tokens) for rid in queued_ids] == [("success", 8)] * 2
    assert_settled(world.failover, [undisturbed_id, streamed_id, *queued_ids])
    restart(stack, "a")


def test_a_websocket_stream_rides_out_the_loss_of_its_replica(world):
    import websocket

    stack = world.stack
    expected = stack.client(world.raw_key_failover).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=FAILOVER_MAX_TOKENS, temperature=0, extra_body=LONG
    )
    ws = websocket.create_connection(
        stack.ws_url, subprotocols=["pagoda.v1", f"pagoda.bearer.{world.raw_key_failover}"], timeout=60
    )
    try:
        assert json.loads(ws.recv()) == {"type": "authenticated"}
        with held_by(stack, "a"):
            request = {"model": MODEL, "messages": MESSAGES, "max_tokens": FAILOVER_MAX_TOKENS,
                       "temperature": 0, **LONG}  # fmt: skip
            ws.send(json.dumps({"type": "chat", "id": "s1", "request": request}))
            messages = [json.loads(ws.recv()) for _ in range(3)]
        stack.kill("a")
        while messages[-1]["type"] == "delta":
            messages.append(json.loads(ws.recv()))
    finally:
        ws.close()

    done = messages[-1]
    assert [m["type"] for m in messages] == ["delta"] * (len(messages) - 1) + ["done"], messages[-1]
    assert "".join(m["content"] for m in messages[:-1]) == expected.choices[0].message.content
    assert done["usage"]["completion_tokens"] == FAILOVER_MAX_TOKENS
    assert took_over(done["request_id"]) == ["b"]
    assert UsageRecord.objects.filter(request_id=done["request_id"]).get().status == "success"
    restart(stack, "a")


def test_a_json_schema_stream_still_validates_after_a_failover(world):
    stack = world.stack
    client = stack.client(world.raw_key_failover)
    # Long enough to be cut in the middle, short enough to complete within max_tokens.
    codes = {
        "type": "array",
        "minItems": 40,
        "maxItems": 48,
        "items": {"type": "integer", "minimum": 1000, "maximum": 99999},
    }
    schema = {
        "type": "object",
        "properties": {"codes": codes},
        "required": ["codes"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "codes", "schema": schema}}
    undisturbed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=1000, response_format=response_format
    )
    with held_by(stack, "a"):
        stream = chat_stream(client, response_format=response_format, max_tokens=1000)
        chunks = iter(stream)
        received = [next(chunks) for _ in range(4)]
    stack.kill("a")
    received.extend(chunks)

    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    finish = [c.choices[0].finish_reason for c in received if c.choices][-1]
    assert took_over(stream.response.headers["x-request-id"]) == ["b"]
    assert finish == "stop"
    assert text == undisturbed.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    restart(stack, "a")


def test_a_stop_string_after_the_failover_still_ends_the_stream_where_it_would_have(world):
    stack = world.stack
    client = stack.client(world.raw_key_failover)
    free = (
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=FAILOVER_MAX_TOKENS, temperature=0, extra_body=LONG
        )
        .choices[0]
        .message.content
    )
    # A stop string late in the text (after any point the kill can come at), first found there.
    at = next(
        i
        for i in range(len(free) * 3 // 4, len(free) - 3)
        if free.find(free[i : i + 3]) == i and free[i : i + 3].strip()
    )
    stop = free[at : at + 3]
    with held_by(stack, "a"):
        stream = chat_stream(client, stop=[stop], extra_body=LONG)
        chunks = iter(stream)
        received = [next(chunks) for _ in range(4)]
    stack.kill("a")
    received.extend(chunks)

    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert took_over(stream.response.headers["x-request-id"]) == ["b"]
    assert text == free[:at]
    assert [c.choices[0].finish_reason for c in received if c.choices][-1] == "stop"
    restart(stack, "a")
