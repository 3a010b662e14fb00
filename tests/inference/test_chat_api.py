"""POST /v1/chat/completions against a scripted engine replica on the real Redis."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from inference.tokenization import chat_prompt_ids
from tenants.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/chat/completions"
HELLO = [("Hel", [11, 12]), ("lo!", [13])]


async def post(world, body: dict, raw_key: str | None = None):
    return await AsyncClient().post(URL, json.dumps(body), content_type="application/json", headers=world.headers(raw_key))


def chat_body(world, **extra) -> dict:
    return {"model": world.model, "messages": [{"role": "user", "content": "Hi there"}], **extra}


async def ledger(request_id: str | None = None) -> list[UsageRecord]:
    qs = UsageRecord.objects.all() if request_id is None else UsageRecord.objects.filter(request_id=request_id)
    return await sync_to_async(list)(qs)


async def test_chat_completion_has_openai_shape_and_one_ledger_row(world):
    await world.engine.heartbeat()
    served = asyncio.create_task(world.engine.serve_one(HELLO, cached_tokens=3))

    response = await post(world, chat_body(world, max_tokens=5, temperature=0, seed=7, stop=["\n"]))

    assert response.status_code == 200
    body = response.json()
    request = await served
    request_id = response["x-request-id"]
    assert body == {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": body["created"],
        "model": world.model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": len(request.prompt_token_ids),
            "completion_tokens": 3,
            "total_tokens": len(request.prompt_token_ids) + 3,
            "prompt_tokens_details": {"cached_tokens": 3},
        },
    }
    # The prompt is the chat template's rendering; the cache salt is the tenant's, set by the server.
    expected_ids = await sync_to_async(chat_prompt_ids)(world.deployment.model_path, [{"role": "user", "content": "Hi there"}])
    assert request.prompt_token_ids == expected_ids
    assert request.cache_salt == f"tenant:{world.tenant_a.id}"
    assert request.tenant == world.tenant_a.slug
    assert request.sampling_params == {
        "temperature": 0.0, "seed": 7, "n": 1, "max_tokens": 5, "stop": ["\n"],
    }
    rows = await ledger()
    assert [(r.request_id, r.status, r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in rows] == [
        (request_id, "success", len(expected_ids), 3, 3)
    ]


async def test_cache_salt_in_the_body_is_refused(world):
    await world.engine.heartbeat()
    response = await post(world, chat_body(world, cache_salt="someone-else"))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"
    assert await world.engine.queued_count() == 0


async def test_streamed_chat_sends_role_content_finish_usage_then_done(world):
    await world.engine.heartbeat()
    served = asyncio.create_task(world.engine.serve_one(HELLO))

    response = await post(world, chat_body(world, stream=True, stream_options={"include_usage": True}))

    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    await served
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    rid = response["x-request-id"]
    assert {c["id"] for c in chunks} == {f"chatcmpl-{rid}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [c["choices"] for c in chunks[:-1]] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "lo!"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
    ]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert len(await ledger(rid)) == 1


async def test_chat_logprobs_have_openai_shape(world):
    await world.engine.heartbeat()
    served = asyncio.create_task(world.engine.serve_one([("a", [65])], logprobs=True))

    response = await post(world, chat_body(world, logprobs=True, top_logprobs=2))

    await served
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 1
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert content[0]["logprob"] == -0.5
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5]


async def test_n_choices_are_indexed(world):
    await world.engine.heartbeat()
    served = asyncio.create_task(world.engine.serve_one(HELLO))
    response = await post(world, chat_body(world, n=2))
    request = await served
    assert request.sampling_params["n"] == 2
    choices = response.json()["choices"]
    assert [(c["index"], c["message"]["content"]) for c in choices] == [(0, "Hello!"), (1, "Hello!")]
    assert response.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": 3}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
async def test_unsupported_or_invalid_fields_are_a_400_naming_the_param(world, extra, param):
    await world.engine.heartbeat()
    response = await post(world, chat_body(world, **extra))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert response["x-request-id"]
    assert await world.engine.queued_count() == 0


async def test_bad_key_is_401_with_request_id(world):
    response = await post(world, chat_body(world), raw_key="sk-nope_nope")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response["x-request-id"]


async def test_unknown_model_and_another_tenants_model_are_404(world):
    await world.engine.heartbeat()
    unknown = await post(world, {**chat_body(world), "model": "no-such-model"})
    other = await post(world, chat_body(world), raw_key=world.raw_key_b)
    for response in (unknown, other):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
    assert await world.engine.queued_count() == 0
    assert await ledger() == []


async def test_too_long_prompt_is_400_naming_both_numbers(world):
    await world.engine.heartbeat()
    response = await post(world, chat_body(world, max_tokens=250))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    prompt_len = len(await sync_to_async(chat_prompt_ids)(world.deployment.model_path, [{"role": "user", "content": "Hi there"}]))
    assert "maximum context length is 256 tokens" in error["message"]
    assert f"requested {prompt_len + 250} tokens ({prompt_len} in the messages, 250 in the completion)" in error["message"]
    assert await world.engine.queued_count() == 0


async def test_no_live_replica_is_503_and_nothing_is_queued_or_billed(world):
    response = await post(world, chat_body(world))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert await world.engine.queued_count() == 0
    assert await ledger() == []


async def test_engine_error_mid_stream_is_an_error_event_then_done(world):
    from engine.protocol import DeltaOutput, Event, Usage

    await world.engine.heartbeat()

    async def fail():
        request = await world.engine.next_request()
        await world.engine.emit(request.request_id, Event.delta([DeltaOutput(0, "Hi", [5, 6])]))
        await world.engine.emit(request.request_id, Event.error("boom", "engine_error", Usage(4, 2)))

    served = asyncio.create_task(fail())
    response = await post(world, chat_body(world, stream=True))
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    await served
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_error"}
    }
    [row] = await ledger(response["x-request-id"])
    assert (row.status, row.completion_tokens) == ("error", 2)
