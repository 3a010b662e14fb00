"""The serving path end to end with the official `openai` client: a real daphne serving
config.asgi, a real engine replica on a tiny random model (CPU), PostgreSQL and Redis.

Tenant A may use the model; tenant B may not (it plays the outsider); tenant C, A's neighbour,
may use it too (for cache isolation); tenant L may make three requests a minute. Every request
goes over HTTP to daphne, through Redis to the engine process and back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import openai
import pytest

from tenants.models import ApiKey, Tenant, UsageRecord
from tenants.services import api_key_create, tenant_create
from tests.e2e.stack import ServingStack, served_world

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

MODEL = "e2e-tiny-chat"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
MESSAGES = [{"role": "user", "content": "Tell me about the pagodas of Kyoto."}]
PROMPT = "The old pagoda on the hill above the river"
# ignore_eos: a random model may end any reply at once; the tests need replies of a known length.
LONG = {"ignore_eos": True}


@dataclass
class World:
    stack: ServingStack
    tenant_a: Tenant
    key_a: ApiKey
    raw_key_a: str
    raw_key_b: str
    raw_key_c: str
    limited: Tenant
    raw_key_limited: str

    @cached_property
    def a(self) -> openai.OpenAI:
        return self.stack.client(self.raw_key_a)

    @cached_property
    def b(self) -> openai.OpenAI:
        return self.stack.client(self.raw_key_b)


@pytest.fixture(scope="module")
def world(committed_db, e2e_model_dir, tmp_path_factory) -> Iterator[World]:
    # A may use the model, B only one of its own; C and a rate-limited tenant besides.
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["solo"],
        model=MODEL,
        model_dir=e2e_model_dir,
        max_model_len=MAX_MODEL_LEN,
        engine_settings={
            "num_blocks": 128,
            "block_size": BLOCK_SIZE,
            "max_num_seqs": 8,
        },
        tenant_a={"slug": "e2e-a"},
        tenant_b={"slug": "e2e-b", "allowed_models": ["b-own-model"]},
    ) as (base, stack):
        with committed_db():
            tenant_c = tenant_create(name="Tenant C", slug="e2e-c", allowed_models=[MODEL])
            limited = tenant_create(
                name="Tenant L", slug="e2e-limited", requests_per_minute=3, allowed_models=[MODEL]
            )
            _, raw_key_c = api_key_create(tenant=tenant_c, name="c-key")
            _, raw_key_limited = api_key_create(tenant=limited, name="limited-key")
        yield World(
            stack,
            base.tenant_a,
            base.key_a,
            base.raw_key_a,
            base.raw_key_b,
            raw_key_c,
            limited,
            raw_key_limited,
        )


def stream_texts(stream, text_of) -> tuple[dict[int, str], dict[int, str], list]:
    """Text (``text_of`` a streamed choice) and finish reason per choice index, and the chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + text_of(choice)
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def chat_stream_texts(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Of a streamed chat completion: the content of the deltas."""
    return stream_texts(stream, lambda choice: choice.delta.content or "")


def completion_stream_texts(stream) -> tuple[dict[int, str], dict[int, str], list]:
    return stream_texts(stream, lambda choice: choice.text)


def ledger_row(response_id: str) -> UsageRecord:
    # Response ids are "chatcmpl-<request id>" / "cmpl-<request id>"; the ledger keys on the request id.
    return UsageRecord.objects.get(request_id=response_id.split("-", 1)[1])


# --- models ----------------------------------------------------------------------------------------


def test_models_lists_the_model_to_the_tenant_allowed_to_use_it_and_not_to_the_outsider(world):
    assert [m.id for m in world.a.models.list()] == [MODEL]
    assert [m.id for m in world.b.models.list()] == []


def test_models_retrieve_answers_the_tenant_allowed_and_404s_the_outsider(world):
    model = world.a.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "pagoda")
    assert model == world.a.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as refused:
        world.b.models.retrieve(MODEL)
    assert refused.value.code == "model_not_found"


# --- streamed equals non-streamed ------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1, "seed": 1234}],
    ids=["greedy", "seeded"],
)
def test_streamed_chat_text_equals_the_non_streamed_text(world, sampling):
    raw = world.a.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, extra_body=LONG, **sampling
    )
    full = raw.parse()
    texts, reasons, chunks = chat_stream_texts(
        world.a.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, stream=True, extra_body=LONG, **sampling
        )
    )

    assert full.object == "chat.completion"
    assert full.id == f"chatcmpl-{raw.headers['x-request-id']}"
    assert (full.choices[0].message.role, full.choices[0].finish_reason) == ("assistant", "length")
    assert full.usage.completion_tokens == 20
    assert full.choices[0].message.content != ""
    assert texts == {0: full.choices[0].message.content}
    assert reasons == {0: "length"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    # The ledger has the request under the id the client saw, with the usage it was told.
    row = ledger_row(full.id)
    assert (row.tenant_id, row.api_key_id, row.model, row.status) == (
        world.tenant_a.id,
        world.key_a.id,
        MODEL,
        "success",
    )
    assert (row.prompt_tokens, row.completion_tokens) == (full.usage.prompt_tokens, 20)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1, "seed": 1234}],
    ids=["greedy", "seeded"],
)
def test_streamed_completion_text_equals_the_non_streamed_text(world, sampling):
    full = world.a.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, extra_body=LONG, **sampling)
    texts, reasons, chunks = completion_stream_texts(
        world.a.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, stream=True, extra_body=LONG, **sampling
        )
    )

    assert full.object == "text_completion"
    assert (full.choices[0].finish_reason, full.usage.completion_tokens) == ("length", 20)
    assert full.choices[0].text != ""
    assert texts == {0: full.choices[0].text}
    assert reasons == {0: "length"}
    assert {c.object for c in chunks} == {"text_completion"}


def test_a_fixed_seed_repeats_its_sample_and_another_seed_draws_another(world):
    def sample(seed: int) -> str:
        return (
            world.a.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1, seed=seed, extra_body=LONG
            )
            .choices[0]
            .text
        )

    greedy = world.a.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body=LONG
    )
    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    assert greedy.choices[0].text != first


# --- n, stop, logprobs, usage ------------------------------------------------------------------------


def test_n2_returns_two_different_samples_streamed_as_non_streamed(world):
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=10, n=2, temperature=1, seed=7, extra_body=LONG)
    full = world.a.chat.completions.create(**params)
    texts, reasons, _ = chat_stream_texts(world.a.chat.completions.create(stream=True, **params))

    assert [c.index for c in full.choices] == [0, 1]
    assert [c.finish_reason for c in full.choices] == ["length", "length"]
    assert full.usage.completion_tokens == 20
    assert full.choices[0].message.content != full.choices[1].message.content
    assert texts == {0: full.choices[0].message.content, 1: full.choices[1].message.content}
    assert reasons == {0: "length", 1: "length"}


def test_echo_scores_the_prompt_through_the_sdk_as_lm_eval_asks(world):
    raw = world.a.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    zero = world.a.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    extra = world.a.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )

    choice = raw.parse().choices[0]
    assert raw.headers["x-request-id"]
    assert choice.text.startswith(PROMPT)
    scored = choice.logprobs.token_logprobs
    assert scored[0] is None and all(isinstance(lp, float) and lp <= 0 for lp in scored[1:])
    assert choice.logprobs.top_logprobs[0] is None and len(choice.logprobs.tokens) == len(scored)
    assert zero.choices[0].text == PROMPT and zero.usage.completion_tokens == 0
    # The prompt's scores do not depend on whether a completion follows them.
    alone = zero.choices[0].logprobs.token_logprobs
    assert alone[0] is None and alone[1:] == pytest.approx(scored[1:-1], abs=1e-5)
    prompt_logprobs = extra.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(scored) - 1


def test_the_current_sdk_fields_are_accepted_and_the_callers_ids_recorded(world):
    reply = world.a.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        safety_identifier="user-7f3a",
        prompt_cache_key="faq-v2",
        metadata={"team": "support"},
        store=False,
    )
    completion = world.a.completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="legacy-user")

    assert reply.choices[0].finish_reason == "length"
    chat_row, completion_row = ledger_row(reply.id), ledger_row(completion.id)
    assert (chat_row.end_user, chat_row.prompt_cache_key) == ("user-7f3a", "faq-v2")
    assert (completion_row.end_user, completion_row.prompt_cache_key) == ("legacy-user", "")
    with pytest.raises(openai.BadRequestError) as refused:
        world.a.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, store=True
        )
    assert refused.value.body["param"] == "store"


def test_a_stop_string_ends_the_text_before_it_streamed_and_not(world):
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, extra_body=LONG)
    text = world.a.completions.create(**params).choices[0].text
    # A stop string the greedy reply really contains, first seen past its middle.
    stop = next(
        text[k : k + 3]
        for k in range(len(text) // 2, len(text) - 3)
        if text[k : k + 3].strip() == text[k : k + 3] and text.find(text[k : k + 3]) == k
    )
    expected = text[: text.index(stop)]

    stopped = world.a.completions.create(stop=[stop], **params)
    texts, reasons, _ = completion_stream_texts(world.a.completions.create(stop=stop, stream=True, **params))

    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (expected, "stop")
    assert stopped.usage.completion_tokens < 32
    assert texts == {0: expected}
    assert reasons == {0: "stop"}


def test_chat_logprobs_carry_the_top_two_per_token_and_the_greedy_token_leads_them(world):
    params = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=LONG,
    )
    full = world.a.chat.completions.create(**params)
    content = full.choices[0].logprobs.content
    _, _, chunks = chat_stream_texts(world.a.chat.completions.create(stream=True, **params))
    streamed = [entry for c in chunks for ch in c.choices if ch.logprobs for entry in ch.logprobs.content]

    assert len(content) == 8
    assert [len(entry.top_logprobs) for entry in content] == [2] * 8
    for entry in content:
        assert entry.logprob <= 0
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    assert "".join(entry.token for entry in content) == full.choices[0].message.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_list_tokens_offsets_and_two_alternatives(world):
    full = world.a.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, extra_body=LONG
    )
    logprobs = full.choices[0].logprobs

    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert "".join(logprobs.tokens) == full.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 2  # two token ids may read as the same text
        assert top[token] == logprob == max(top.values())


def test_include_usage_adds_a_final_chunk_with_usage_and_no_choices(world):
    chunks = list(
        world.a.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=LONG,
        )
    )
    full = world.a.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=LONG
    )

    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.usage.prompt_tokens,
        6,
        full.usage.prompt_tokens + 6,
    )


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache_of_its_own_tenant_only(world):
    prompt = " ".join(f"pagoda{i} roof{i * 7 % 13} bell" for i in range(24))
    first = world.a.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = world.a.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    neighbour = world.stack.client(world.raw_key_c).completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0
    )

    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 4 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Every full block but the one holding the last prompt token (which must be computed again).
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert ledger_row(second.id).cached_tokens == second.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].text == first.choices[0].text
    # Another tenant's identical prompt finds nothing: the cache is keyed by tenant.
    assert neighbour.usage.prompt_tokens == prompt_tokens
    assert neighbour.usage.prompt_tokens_details.cached_tokens == 0


# --- refusals --------------------------------------------------------------------------------------


def test_a_bad_key_is_refused_with_401_and_nothing_is_written(world):
    before = UsageRecord.objects.count()
    for bad in ["sk-000000000000_" + "x" * 43, "not-a-key"]:
        with pytest.raises(openai.AuthenticationError) as caught:
            world.stack.client(bad).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert caught.value.status_code == 401
        assert caught.value.response.headers["x-request-id"]
    assert UsageRecord.objects.count() == before


def test_an_unknown_model_and_another_tenants_model_are_both_404_model_not_found(world):
    before = UsageRecord.objects.count()
    with pytest.raises(openai.NotFoundError) as unknown:
        world.a.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as not_theirs:
        world.b.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)

    for caught, name in [(unknown, "no-such-model"), (not_theirs, MODEL)]:
        assert caught.value.status_code == 404
        assert caught.value.code == "model_not_found"
        assert name in caught.value.message
    assert UsageRecord.objects.count() == before


def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded_naming_both_numbers(world):
    before = UsageRecord.objects.count()
    with pytest.raises(openai.BadRequestError) as caught:
        world.a.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=16)

    assert caught.value.status_code == 400
    assert caught.value.code == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in caught.value.message
    assert "you requested 316 tokens (300 in the prompt, 16 in the completion)" in caught.value.message
    assert UsageRecord.objects.count() == before


def test_the_fourth_request_in_a_minute_is_429_with_rate_limit_headers(world):
    client = world.stack.client(world.raw_key_limited)
    remaining = []
    for _ in range(3):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])

    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)

    assert remaining == ["2", "1", "0"]
    headers = caught.value.response.headers
    assert caught.value.status_code == 429
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "0")
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert UsageRecord.objects.filter(tenant=world.limited).count() == 3


# --- websocket -------------------------------------------------------------------------------------


def ws_connect(world: World, raw_key: str):
    import websocket

    ws = websocket.create_connection(
        world.stack.ws_url, subprotocols=["pagoda.v1", f"pagoda.bearer.{raw_key}"], timeout=60
    )
    return ws, json.loads(ws.recv())


def test_websocket_runs_two_streams_at_once_with_the_texts_of_the_rest_api(world):
    questions = {"s1": MESSAGES, "s2": [{"role": "user", "content": "And the bells?"}]}
    expected = {
        sid: world.a.chat.completions.create(
            model=MODEL, messages=m, max_tokens=12, temperature=0, extra_body=LONG
        )
        for sid, m in questions.items()
    }
    ws, hello = ws_connect(world, world.raw_key_a)
    try:
        assert hello == {"type": "authenticated"}
        for sid, messages in questions.items():
            request = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **LONG}
            ws.send(json.dumps({"type": "chat", "id": sid, "request": request}))
        texts = {sid: "" for sid in questions}
        done = {}
        while len(done) < len(questions):
            message = json.loads(ws.recv())
            assert message["type"] in ("delta", "done"), message
            if message["type"] == "delta":
                texts[message["id"]] += message["content"]
            else:
                done[message["id"]] = message
    finally:
        ws.close()

    assert texts == {sid: r.choices[0].message.content for sid, r in expected.items()}
    for sid, message in done.items():
        assert message["finish_reason"] == "length"
        assert message["usage"]["completion_tokens"] == 12
        assert message["usage"]["prompt_tokens"] == expected[sid].usage.prompt_tokens
        assert UsageRecord.objects.get(request_id=message["request_id"]).status == "success"


def test_websocket_cancel_stops_a_stream_and_bills_what_was_produced(world):
    ws, _ = ws_connect(world, world.raw_key_a)
    try:
        request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0, **LONG}
        ws.send(json.dumps({"type": "chat", "id": "long", "request": request}))
        deltas = 0
        while True:
            message = json.loads(ws.recv())
            if message["type"] == "delta":
                deltas += 1
                if deltas == 3:
                    ws.send(json.dumps({"type": "cancel", "id": "long"}))
            else:
                break
    finally:
        ws.close()

    assert message["type"] == "cancelled"
    produced = message["usage"]["completion_tokens"]
    assert deltas <= produced < 200
    row = UsageRecord.objects.get(request_id=message["request_id"])
    assert (row.status, row.completion_tokens) == ("cancelled", produced)


def test_websocket_with_a_bad_key_gets_an_error_and_is_closed_with_4401(world):
    import websocket

    ws, first = ws_connect(world, "sk-000000000000_" + "x" * 43)
    try:
        opcode, frame = ws.recv_data_frame(control_frame=True)
    finally:
        ws.close()

    assert (first["type"], first["id"], first["error"]["code"]) == ("error", None, "invalid_api_key")
    assert opcode == websocket.ABNF.OPCODE_CLOSE
    assert struct.unpack("!H", frame.data[:2])[0] == 4401
