"""POST /v1/chat/completions answered by a real engine replica of the tiny model (greedy, so every
answer is checked against the engine's own offline output for the request that was queued)."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from inference.tokenization import chat_prompt_ids
from tenants.models import UsageRecord
from tenants.services import usage_record_create
from tests.helpers import api_post, sse_events
from tests.inference.conftest import (
    cached_prefix_len,
    offline_outputs,
    queued_requests,
    running_engine_worker,
)

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/chat/completions"
# Long enough for several full KV blocks of 16 tokens.
LONG = (
    "Summarize the following notes about the harbor, the lighthouse, the ferry timetable and the fish market. "
    * 2
)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def chat_body(world, content: str = "Hi there", **extra) -> dict:
    return {"model": world.model, "messages": [{"role": "user", "content": content}], **extra}


async def ledger(request_id: str | None = None) -> list[UsageRecord]:
    qs = (
        UsageRecord.objects.all() if request_id is None else UsageRecord.objects.filter(request_id=request_id)
    )
    return await sync_to_async(list)(qs.order_by("created_at"))


async def test_chat_completion_has_openai_shape_and_one_ledger_row(world, engine_worker, reference_llm):
    response = await api_post(
        world, URL, chat_body(world, max_tokens=5, temperature=0, seed=7, stop=["\n"], ignore_eos=True)
    )

    assert response.status_code == 200
    body = response.json()
    request_id = response["x-request-id"]
    [request] = await queued_requests(world.model)
    [expected] = offline_outputs(reference_llm, request)
    prompt_len = len(request.prompt_token_ids)
    assert body == {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": body["created"],
        "model": world.model,
        "system_fingerprint": None,
        "service_tier": "default",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": expected.text, "refusal": None},
                "logprobs": None,
                "finish_reason": expected.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": 5,
            "total_tokens": prompt_len + 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert len(expected.token_ids) == 5 and expected.text
    # The prompt is the chat template's rendering; the cache salt is the tenant's, set by the server.
    expected_ids = await sync_to_async(chat_prompt_ids)(
        world.deployment.model_path, [{"role": "user", "content": "Hi there"}]
    )
    assert request.prompt_token_ids == expected_ids
    assert request.request_id == request_id
    assert request.cache_salt == f"tenant:{world.tenant_a.id}"
    assert request.tenant == world.tenant_a.slug
    assert request.sampling_params == {
        "temperature": 0.0,
        "seed": 7,
        "ignore_eos": True,
        "n": 1,
        "max_tokens": 5,
        "stop": ["\n"],
    }
    rows = await ledger()
    assert [
        (r.request_id, r.status, r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in rows
    ] == [(request_id, "success", len(expected_ids), 5, 0)]


async def test_streamed_chat_sends_role_then_the_same_text_as_the_plain_answer_then_finish_usage_done(
    world, engine_worker
):
    body = chat_body(world, max_tokens=8, temperature=0, ignore_eos=True)
    plain = (await api_post(world, URL, body)).json()

    response = await api_post(world, URL, {**body, "stream": True, "stream_options": {"include_usage": True}})

    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    events = sse_events(b"".join([chunk async for chunk in response.streaming_content]))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    rid = response["x-request-id"]
    assert {c["id"] for c in chunks} == {f"chatcmpl-{rid}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    first, *content, finish, usage = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert content and all(
        c["choices"]
        == [
            {
                "index": 0,
                "delta": {"content": c["choices"][0]["delta"]["content"]},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        for c in content
    )
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == plain["choices"][0]["message"]["content"]
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert [(r.status, r.completion_tokens) for r in await ledger(rid)] == [("success", 8)]


async def test_a_repeated_prompt_of_several_blocks_reports_its_cached_tokens(world, engine_worker):
    body = chat_body(world, LONG, max_tokens=3, temperature=0, ignore_eos=True)

    first = (await api_post(world, URL, body)).json()
    second = (await api_post(world, URL, body)).json()

    prompt_len = first["usage"]["prompt_tokens"]
    assert prompt_len > 3 * 16
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached_prefix_len(prompt_len)}
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    rows = await ledger()
    assert [(r.request_id, r.cached_tokens) for r in rows] == [
        (first["id"].removeprefix("chatcmpl-"), 0),
        (second["id"].removeprefix("chatcmpl-"), cached_prefix_len(prompt_len)),
    ]


async def test_chat_logprobs_have_openai_shape_and_greedy_picks_the_top_token(world, engine_worker):
    response = await api_post(
        world,
        URL,
        chat_body(world, max_tokens=4, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2),
    )

    assert response.status_code == 200
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        best, runner_up = entry["top_logprobs"]
        assert (best["token"], best["logprob"]) == (entry["token"], entry["logprob"])
        assert 0.0 >= best["logprob"] >= runner_up["logprob"]


async def test_n_choices_are_indexed_and_greedy_choices_agree(world, engine_worker):
    single = (
        await api_post(world, URL, chat_body(world, max_tokens=6, temperature=0, ignore_eos=True))
    ).json()

    response = await api_post(world, URL, chat_body(world, max_tokens=6, temperature=0, ignore_eos=True, n=2))

    assert response.status_code == 200
    requests = await queued_requests(world.model)
    assert [r.sampling_params["n"] for r in requests] == [1, 2]
    text = single["choices"][0]["message"]["content"]
    choices = response.json()["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == [
        (0, text, "length"),
        (1, text, "length"),
    ]
    assert response.json()["usage"]["completion_tokens"] == 12


async def test_a_stop_string_from_the_greedy_answer_cuts_the_answer_before_it(world, engine_worker):
    body = chat_body(world, max_tokens=12, temperature=0, ignore_eos=True)
    full = (await api_post(world, URL, body)).json()["choices"][0]["message"]["content"]
    # The first two letters in a row past the first character: a stop string that does occur.
    start = next(
        i for i in range(1, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isalpha()
    )
    stop = full[start : start + 2]

    response = await api_post(world, URL, {**body, "stop": [stop, "never-in-it"]})

    [choice] = response.json()["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == (full[: full.index(stop)], "stop")
    assert response.json()["usage"]["completion_tokens"] < 12


async def test_cache_salt_in_the_body_is_refused(world):
    response = await api_post(world, URL, chat_body(world, cache_salt="someone-else"))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"
    assert await queued_requests(world.model) == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": 3}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": 5}, "model"),
        # Found by the schema fuzzer (500s before): a role that is not a string, and integers
        # beyond the 64 bits the engine's wire format carries.
        ({"messages": [{"role": {}, "content": "x"}]}, "messages"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 10**23}, "top_k"),
    ],
)
async def test_unsupported_or_invalid_fields_are_a_400_naming_the_param(world, extra, param):
    response = await api_post(world, URL, chat_body(world, **extra))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert response["x-request-id"]
    assert await queued_requests(world.model) == []


async def test_a_model_that_is_not_a_string_is_a_wrong_type_not_an_unknown_model(world):
    response = await api_post(world, URL, {**chat_body(world), "model": 5})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Not a valid string.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "invalid",
    }


async def test_an_unknown_field_is_unknown_parameter_as_on_usage(world):
    chat = await api_post(world, URL, chat_body(world, frobnicate=1))
    usage = await AsyncClient().get("/v1/usage?frobnicate=1", headers=world.headers())
    for response in (chat, usage):
        assert response.status_code == 400
        assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (
            "frobnicate",
            "unknown_parameter",
        )


async def test_bad_key_is_401_with_request_id(world):
    response = await api_post(world, URL, chat_body(world), raw_key="sk-nope_nope")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response["x-request-id"]


async def test_unknown_model_and_another_tenants_model_are_404(world):
    unknown = await api_post(world, URL, {**chat_body(world), "model": "no-such-model"})
    other = await api_post(world, URL, chat_body(world), raw_key=world.raw_key_b)
    for response in (unknown, other):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
    assert await queued_requests(world.model) == []
    assert await ledger() == []


async def test_too_long_prompt_is_400_naming_both_numbers(world):
    response = await api_post(world, URL, chat_body(world, max_tokens=250))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    prompt_len = len(
        await sync_to_async(chat_prompt_ids)(
            world.deployment.model_path, [{"role": "user", "content": "Hi there"}]
        )
    )
    assert "maximum context length is 256 tokens" in error["message"]
    assert (
        f"requested {prompt_len + 250} tokens ({prompt_len} in the messages, 250 in the completion)"
        in error["message"]
    )
    assert await queued_requests(world.model) == []


async def test_no_live_replica_is_503_and_nothing_is_queued_or_billed(world):
    response = await api_post(world, URL, chat_body(world))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert await queued_requests(world.model) == []
    assert await ledger() == []


async def test_a_model_whose_only_replica_is_draining_takes_no_new_request(world):
    # The draining replica is live (what it holds is in good hands) but takes nothing new: a new
    # request must not wait in a queue nobody will read.
    await world.faults.heartbeat(draining=True)
    response = await api_post(world, URL, chat_body(world))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert await queued_requests(world.model) == []
    assert await ledger() == []


@pytest.mark.world(tenant_a={"monthly_token_quota": 1000})
async def test_an_exhausted_monthly_quota_is_429_insufficient_quota_and_nothing_is_queued(world):
    # Earlier this month the tenant used its whole quota.
    await sync_to_async(usage_record_create)(
        tenant_id=world.tenant_a.pk,
        api_key_id=world.key_a.pk,
        model=world.model,
        adapter=None,
        prompt_tokens=600,
        completion_tokens=400,
        cached_tokens=0,
        time_to_first_token_ms=5.0,
        latency_ms=20.0,
        status="success",
        request_id="earlier",
    )
    with running_engine_worker(world):
        response = await api_post(world, URL, chat_body(world, max_tokens=2))

    assert response.status_code == 429
    assert response["x-should-retry"] == "false"
    assert response["x-request-id"]
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert await queued_requests(world.model) == []
    assert [r.request_id for r in await ledger()] == ["earlier"]


async def test_engine_error_mid_stream_is_an_error_event_then_done(world):
    from engine.protocol import DeltaOutput, Event, Usage

    await world.faults.heartbeat()

    async def fail_after_two_tokens():
        request = await world.faults.next_request()
        await world.faults.emit(request.request_id, Event.delta([DeltaOutput(0, "Hi", [5, 6])]))
        await world.faults.emit(request.request_id, Event.error("boom", "engine_error", Usage(4, 2)))

    faulted = asyncio.create_task(fail_after_two_tokens())
    response = await api_post(world, URL, chat_body(world, stream=True))
    events = sse_events(b"".join([chunk async for chunk in response.streaming_content]))
    await faulted

    assert [json.loads(e)["choices"][0]["delta"] for e in events[:-2]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]
    assert json.loads(events[-2]) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_error"}
    }
    assert events[-1] == "[DONE]"
    [row] = await ledger(response["x-request-id"])
    assert (row.status, row.completion_tokens) == ("error", 2)


async def test_a_malformed_engine_event_ends_the_stream_with_a_server_error_and_aborts(world):
    from engine.protocol import DeltaOutput, Event

    await world.faults.heartbeat()
    response = await api_post(world, URL, chat_body(world, stream=True))
    request = await world.faults.next_request()
    await world.faults.emit(request.request_id, Event.delta([DeltaOutput(0, "Hi", [5, 6])]))
    chunks = aiter(response.streaming_content)
    role, hi = [json.loads(sse_events(await anext(chunks))[0]) for _ in range(2)]

    await world.faults.emit_raw(request.request_id, {"data": '{"v": 999, "type": "delta"}'})

    rest = sse_events(b"".join([chunk async for chunk in chunks]))
    assert (role["choices"][0]["delta"], hi["choices"][0]["delta"]) == (
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    )
    assert [json.loads(rest[0]), rest[1]] == [
        {
            "error": {
                "message": "The server had an error while processing your request.",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        },
        "[DONE]",
    ]
    assert await world.faults.cancels() == [request.request_id]
    [row] = await ledger(response["x-request-id"])
    assert (row.status, row.completion_tokens) == ("error", 2)


async def test_entries_lost_from_an_output_stream_end_it_with_stream_interrupted_billed_what_was_sent(world):
    """A Redis that crashed may come back without its last writes: the reader sees the engine's
    entry numbers jump, and ends the stream rather than send text with a hole in it."""
    from core.redis_client import get_async_redis
    from engine.protocol import DeltaOutput, Event, output_stream

    await world.faults.heartbeat()
    response = await api_post(world, URL, chat_body(world, stream=True))
    request = await world.faults.next_request()
    key = output_stream(world.faults.prefix, request.request_id)
    stamp = 1_700_000_000_000

    def delta(text: str, token: int) -> dict:
        return Event.delta([DeltaOutput(0, text, [token])]).encode()

    await get_async_redis().xadd(key, delta("Hi", 5), id=f"{stamp}-0")
    await get_async_redis().xadd(key, delta(" there", 6), id=f"{stamp}-1")
    # Entries 2 and 3 were lost with Redis's last second; the engine went on with entry 4.
    await get_async_redis().xadd(key, delta(" friend", 9), id=f"{stamp}-4")
    events = sse_events(b"".join([chunk async for chunk in response.streaming_content]))

    assert [json.loads(e)["choices"][0]["delta"] for e in events[:-2]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
        {"content": " there"},
    ]
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == ("stream_interrupted", "server_error")
    assert events[-1] == "[DONE]"
    assert await world.faults.cancels() == [request.request_id]
    [row] = await ledger(response["x-request-id"])
    assert (row.status, row.completion_tokens) == ("error", 2)


async def test_a_grammar_too_costly_to_enforce_is_a_400_with_its_code_and_billed_its_prompt(world):
    from engine.config import StructuredOutputConfig

    # Given a replica whose bound on a mask's cost no grammar can meet
    bound = StructuredOutputConfig(max_mask_ms=1e-9)
    with running_engine_worker(world, structured_output=bound):
        # When a request asks for a regex
        response = await api_post(
            world, URL, chat_body(world, max_tokens=8, structured_outputs={"regex": "[a-z]{1,20}"})
        )
        # Then it is refused as the sender's fault, with the engine's code and the limit
        assert response.status_code == 400, response.content
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "grammar_too_costly")
        # And a cached refusal keeps its code
        again = await api_post(
            world, URL, chat_body(world, max_tokens=8, structured_outputs={"regex": "[a-z]{1,20}"})
        )
        assert again.status_code == 400 and again.json()["error"]["code"] == "grammar_too_costly"
    # And each started compile is billed for its prompt, nothing for completion
    rows = await ledger(response["x-request-id"])
    assert [(r.completion_tokens, r.prompt_tokens > 0) for r in rows] == [(0, True)]
