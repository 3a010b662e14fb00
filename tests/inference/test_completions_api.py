"""POST /v1/completions: prompt shapes, batching over prompts, legacy logprobs."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.test import AsyncClient

from inference.tokenization import text_prompt_ids

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/completions"


async def post(world, body: dict):
    return await AsyncClient().post(URL, json.dumps(body), content_type="application/json", headers=world.headers())


async def test_text_completion_has_openai_shape(world):
    await world.engine.heartbeat()
    served = asyncio.create_task(world.engine.serve_one([("ab", [7, 8])], finish_reason="length"))

    response = await post(world, {"model": world.model, "prompt": "Once upon", "max_tokens": 2})

    request = await served
    assert request.prompt_token_ids == text_prompt_ids(world.deployment.model_path, "Once upon")
    assert request.sampling_params == {"n": 1, "max_tokens": 2, "stop": []}
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"] == f"cmpl-{response['x-request-id']}"
    assert body["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["completion_tokens"] == 2


async def test_list_of_prompts_is_one_engine_request_each_with_choice_indices(world):
    await world.engine.heartbeat()

    async def serve_two():
        first = await world.engine.next_request()
        second = await world.engine.next_request()
        await world.engine.reply(second, [("B", [2])])
        await world.engine.reply(first, [("A", [1])])
        return first, second

    served = asyncio.create_task(serve_two())
    response = await post(world, {"model": world.model, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 1})
    first, second = await served
    rid = response["x-request-id"]
    assert (first.request_id, first.prompt_token_ids) == (f"{rid}-0", [5, 6, 7])
    assert (second.request_id, second.prompt_token_ids) == (f"{rid}-1", [8, 9])
    body = response.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "A"), (1, "A"), (2, "B"), (3, "B")]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 4


async def test_streamed_completion_with_logprobs(world):
    await world.engine.heartbeat()
    served = asyncio.create_task(world.engine.serve_one([("x", [70]), ("y", [71])], logprobs=True))
    response = await post(world, {"model": world.model, "prompt": [1, 2, 3], "stream": True, "logprobs": 1})
    raw = b"".join([c async for c in response.streaming_content]).decode()
    await served
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert raw.endswith("data: [DONE]\n\n")
    assert {c["object"] for c in chunks} == {"text_completion"}
    first = chunks[0]["choices"][0]
    assert first["text"] == "x"
    assert set(first["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert first["logprobs"]["token_logprobs"] == [-0.5]
    assert len(first["logprobs"]["top_logprobs"][0]) == 1
    second = chunks[1]["choices"][0]
    assert second["logprobs"]["text_offset"] == [1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([], "prompt"), ([1, "a"], "prompt"), ([5000], "prompt"), (None, "prompt")],
)
async def test_bad_prompts_are_400(world, prompt, param):
    await world.engine.heartbeat()
    response = await post(world, {"model": world.model, "prompt": prompt})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert await world.engine.queued_count() == 0


async def test_echo_is_refused(world):
    response = await post(world, {"model": world.model, "prompt": "a", "echo": True})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "echo"
