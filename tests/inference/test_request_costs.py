"""No request may cost the other tenants more than its sender pays (the web tier's side): prompt
logprobs repeated per choice are bounded and built once per prompt, off the event loop; structured
output schemas and tools are bounded before any grammar is built; every websocket message that would
start a stream counts against the rate limit; odd logit_bias keys are a 400, not a 500."""

from __future__ import annotations

import json

import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import AsyncClient

from config.asgi import application
from core.errors import InvalidRequestError
from engine.structured_output.spec import MAX_SPEC_CHARS
from inference.api.completions.render import text_completion_body
from inference.services import GenerationPlan, GenerationUsage
from inference.services.generation import CollectedChoice
from inference.services.logprob_bounds import prompt_logprob_entries, prompt_logprob_volume_check
from tenants.models import UsageRecord
from tests.helpers import api_post
from tests.inference.conftest import MAX_MODEL_LEN, queued_requests

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# A prompt of token ids that nearly fills the tiny model's context (max_tokens 0 runs one more).
LONG_PROMPT = [10 + i % 200 for i in range(MAX_MODEL_LEN - 16)]


def chat_body(world, **extra) -> dict:
    return {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], **extra}


def _plan(**fields) -> GenerationPlan:
    base = {
        "kind": "completion",
        "request_id": "r",
        "model": "m",
        "model_path": "unused",
        "max_model_len": 1 << 20,
        "prompts": [[1]],
        "n": 1,
        "max_tokens": 1,
        "sampling_params": {},
    }
    return GenerationPlan(**{**base, **fields})


# logit_bias


@pytest.mark.parametrize("key", ["²", "١", "9" * 5000], ids=["superscript", "arabic-indic", "5000-digits"])
async def test_a_logit_bias_key_that_is_not_an_ascii_token_id_is_a_400_naming_logit_bias(world, key):
    response = await api_post(world, CHAT, chat_body(world, logit_bias={key: 1}))

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "logit_bias")
    assert await queued_requests(world.model) == []


# Structured output specs and tools


def _schema_of(chars: int) -> dict:
    """A valid JSON schema of about `chars` characters: many described string properties."""
    properties = {f"p{i}": {"type": "string", "description": "d" * 90} for i in range(chars // 120 + 1)}
    return {"type": "object", "properties": properties}


async def test_a_response_format_schema_over_the_spec_bound_is_a_400_naming_response_format(world):
    schema = _schema_of(100 * 1024)
    assert len(json.dumps(schema)) > MAX_SPEC_CHARS
    response_format = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}

    response = await api_post(world, CHAT, chat_body(world, response_format=response_format))

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert str(MAX_SPEC_CHARS) in error["message"]
    assert await queued_requests(world.model) == []


async def test_tools_over_the_spec_bound_are_a_400_naming_tools(world):
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": _schema_of(5 * 1024)}}
        for i in range(20)
    ]
    assert len(json.dumps(tools)) > MAX_SPEC_CHARS

    response = await api_post(world, CHAT, chat_body(world, tools=tools, tool_choice="required"))

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert str(MAX_SPEC_CHARS) in error["message"]
    assert await queued_requests(world.model) == []


# Prompt logprobs


def test_the_default_bound_refuses_the_reviewed_attack_and_lets_lm_eval_score_long_prompts():
    limit = settings.PROMPT_LOGPROB_ENTRIES_MAX
    # n 128 on a 2,048-token prompt, echo with logprobs 20 and prompt_logprobs 20.
    attack = _plan(n=128, prompts=[[1] * 2048], echo=True, logprobs=20, prompt_logprobs=20)
    # lm-evaluation-harness scoring: echo, logprobs 5, max_tokens 0, n 1, a 128k-token prompt.
    lm_eval = _plan(prompts=[[1] * 131_072], echo=True, logprobs=5, prompt_logprobs=5)

    assert prompt_logprob_entries(attack) == 128 * 2048 * (21 + 21) > limit
    with pytest.raises(InvalidRequestError) as refused:
        prompt_logprob_volume_check(attack)
    assert refused.value.param == "logprobs" and str(limit) in str(refused.value)
    assert prompt_logprob_entries(lm_eval) <= limit
    prompt_logprob_volume_check(lm_eval)


async def test_prompt_logprobs_repeated_beyond_the_bound_are_a_400_and_nothing_is_queued_or_billed(
    world, engine_worker, settings
):
    settings.PROMPT_LOGPROB_ENTRIES_MAX = 100_000
    lm_eval = {"model": world.model, "prompt": LONG_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 5}
    # n at the most this deployment takes (a quarter of its replicas' 128 slots).
    attack = {**lm_eval, "logprobs": 20, "prompt_logprobs": 20, "n": 32}

    refused = await api_post(world, COMPLETIONS, attack)

    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "logprobs"), error
    assert "100000" in error["message"]
    assert await queued_requests(world.model) == []
    assert not await UsageRecord.objects.aexists()
    # prompt_logprobs asking for more than logprobs is the field named.
    refused = await api_post(world, COMPLETIONS, {**attack, "logprobs": 1})
    assert refused.json()["error"]["param"] == "prompt_logprobs"
    # Ordinary scoring under the same bound is served.
    served = await api_post(world, COMPLETIONS, lm_eval)
    assert served.status_code == 200, served.content
    assert len(served.json()["choices"][0]["logprobs"]["tokens"]) == len(LONG_PROMPT)


def test_the_choices_of_one_prompt_share_its_logprob_objects(served_model_dir):
    prompt = [11, 12, 13]
    entries = [None] + [
        {"token_id": t, "logprob": -1.0, "rank": 2, "top": [[7, -0.5], [t, -1.0]]} for t in prompt[1:]
    ]
    plan = _plan(
        model_path=str(served_model_dir),
        prompts=[prompt],
        n=3,
        echo=True,
        logprobs=2,
        prompt_logprobs=2,
        discard_output=True,
        prompt_texts=["abc"],
    )
    choices = [CollectedChoice(index=i, finish_reason="length", prompt_logprobs=entries) for i in range(3)]

    body = text_completion_body(plan, choices, GenerationUsage(prompt_tokens=3))

    first, *others = body["choices"]
    assert first["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    for choice in others:
        assert choice["prompt_logprobs"] is first["prompt_logprobs"]
        assert choice["logprobs"]["top_logprobs"][1] is first["logprobs"]["top_logprobs"][1]


# Websocket messages count against requests/min


@pytest.mark.world(tenant_a={"requests_per_minute": 2})
async def test_websocket_chat_messages_that_fail_validation_count_against_requests_per_minute(world):
    communicator = WebsocketCommunicator(
        application, "/ws/v1/chat", subprotocols=["pagoda.v1", f"pagoda.bearer.{world.raw_key_a}"]
    )
    assert (await communicator.connect())[0]
    assert (await communicator.receive_json_from(timeout=10))["type"] == "authenticated"

    codes = []
    for i in range(2):
        bad = {"type": "chat", "id": f"bad{i}", "request": chat_body(world, max_tokens="many")}
        await communicator.send_json_to(bad)
        codes.append((await communicator.receive_json_from(timeout=10))["error"]["code"])
    await communicator.send_to(text_data="not json")
    codes.append((await communicator.receive_json_from(timeout=10))["error"]["code"])
    await communicator.send_json_to({"type": "chat", "id": "ok", "request": chat_body(world, max_tokens=2)})
    refused = await communicator.receive_json_from(timeout=10)

    assert codes[:2] == ["invalid", "invalid"]
    assert codes[2] == "rate_limit_exceeded"
    assert (refused["id"], refused["error"]["code"]) == ("ok", "rate_limit_exceeded")
    assert await queued_requests(world.model) == []
    # HTTP requests of the same key find the limit used up by the websocket's messages too.
    response = await AsyncClient().post(
        CHAT, json.dumps(chat_body(world)), content_type="application/json", headers=world.headers()
    )
    assert response.status_code == 429
    await communicator.disconnect()


# A refusal by a rate limit is held (its Retry-After, at most RATE_LIMIT_HOLD_S): a client that
# asks again at once, ignoring Retry-After, cannot make the web process refuse it as fast as it can.


def test_a_refusals_hold_is_its_retry_after_at_most_the_setting():
    from core.errors import RateLimitError

    assert RateLimitError(headers={"retry-after": "30", "retry-after-ms": "250"}).hold_s(1.0) == 0.25
    assert RateLimitError(headers={"retry-after": "30"}).hold_s(1.0) == 1.0
    assert RateLimitError(headers={"retry-after": "0"}).hold_s(1.0) == 0.0
    assert RateLimitError().hold_s(1.5) == 1.5
    assert RateLimitError(headers={"retry-after": "soon"}).hold_s(1.0) == 1.0
    assert RateLimitError(headers={"retry-after": "30"}).hold_s(0.0) == 0.0


def _refusals(tenant_id: int) -> int:
    import time as time_module

    from tenants.ratelimit.limiter import rate_limited_count

    now = time_module.time()
    hours = {time_module.strftime("%Y-%m-%dT%H", time_module.gmtime(now - s)) for s in (0, 3600)}
    return sum(rate_limited_count(tenant_id=tenant_id, hour=hour) for hour in hours)


@pytest.mark.world(tenant_a={"requests_per_minute": 1})
async def test_a_refused_request_is_held_while_other_tenants_are_answered(world, settings):
    import asyncio

    from asgiref.sync import sync_to_async

    from tests.helpers import async_wait_until

    settings.RATE_LIMIT_HOLD_S = 8.0
    client = AsyncClient()
    assert (await client.get("/v1/models", headers=world.headers())).status_code == 200
    refused_before = await sync_to_async(_refusals)(world.tenant_a.pk)

    # Given tenant A over its requests/min, asking again at once
    held = asyncio.ensure_future(client.get("/v1/models", headers=world.headers()))
    try:

        async def refused() -> bool:
            return await sync_to_async(_refusals)(world.tenant_a.pk) > refused_before

        await async_wait_until(refused, what="A's request refused")
        # When tenant B asks meanwhile
        other = await asyncio.wait_for(
            client.get("/v1/models", headers=world.headers(world.raw_key_b)), timeout=30
        )
        # Then B is answered while A's refusal is still held
        assert other.status_code == 200
        assert not held.done()
    finally:
        refused = await asyncio.wait_for(held, timeout=60)
    assert refused.status_code == 429


@pytest.mark.world(tenant_a={"requests_per_minute": 1})
async def test_a_refusal_is_answered_once_its_hold_is_over(world, settings):
    import time as time_module

    settings.RATE_LIMIT_HOLD_S = 0.5
    client = AsyncClient()
    assert (await client.get("/v1/models", headers=world.headers())).status_code == 200

    started = time_module.monotonic()
    refused = await client.get("/v1/models", headers=world.headers())

    assert time_module.monotonic() - started >= 0.5
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused["retry-after"]) <= 60


@pytest.mark.world(tenant_a={"requests_per_minute": 1})
async def test_a_websocket_client_refused_is_answered_once_a_hold_per_message(world, settings):
    import time as time_module

    settings.RATE_LIMIT_HOLD_S = 0.5
    communicator = WebsocketCommunicator(
        application, "/ws/v1/chat", subprotocols=["pagoda.v1", f"pagoda.bearer.{world.raw_key_a}"]
    )
    assert (await communicator.connect())[0]
    assert (await communicator.receive_json_from(timeout=10))["type"] == "authenticated"
    bad = {"type": "chat", "id": "bad", "request": chat_body(world, max_tokens="many")}
    await communicator.send_json_to(bad)
    assert (await communicator.receive_json_from(timeout=10))["error"]["code"] == "invalid"

    # Three more messages sent at once, each refused by the limit
    started = time_module.monotonic()
    for i in range(3):
        await communicator.send_json_to({**bad, "id": f"again{i}"})
    answers = [await communicator.receive_json_from(timeout=30) for _ in range(3)]

    assert [(a["id"], a["error"]["code"]) for a in answers] == [
        (f"again{i}", "rate_limit_exceeded") for i in range(3)
    ]
    assert time_module.monotonic() - started >= 1.5
    await communicator.disconnect()
