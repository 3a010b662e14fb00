"""POST /v1/completions answered by a real engine replica: prompt shapes, one engine request per
prompt, legacy logprobs."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async

from inference.tokenization import text_prompt_ids
from tests.helpers import api_post
from tests.inference.conftest import offline_outputs, queued_requests

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/completions"


async def test_text_completion_has_openai_shape_and_the_engines_greedy_text(
    world, engine_worker, reference_llm
):
    response = await api_post(
        world, URL, {"model": world.model, "prompt": "Once upon", "max_tokens": 4, "temperature": 0}
    )

    assert response.status_code == 200
    [request] = await queued_requests(world.model)
    assert request.prompt_token_ids == await sync_to_async(text_prompt_ids)(
        world.deployment.model_path, "Once upon"
    )
    assert request.sampling_params == {"temperature": 0.0, "n": 1, "max_tokens": 4, "stop": []}
    [expected] = offline_outputs(reference_llm, request)
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"] == f"cmpl-{response['x-request-id']}"
    assert body["choices"] == [
        {"index": 0, "text": expected.text, "logprobs": None, "finish_reason": expected.finish_reason}
    ]
    assert body["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)


async def test_list_of_prompts_is_one_engine_request_each_with_choice_indices(
    world, engine_worker, reference_llm
):
    response = await api_post(
        world,
        URL,
        {
            "model": world.model,
            "prompt": [[5, 6, 7], [8, 9]],
            "n": 2,
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
        },
    )

    assert response.status_code == 200
    rid = response["x-request-id"]
    first, second = sorted(await queued_requests(world.model), key=lambda r: r.request_id)
    assert (first.request_id, first.prompt_token_ids) == (f"{rid}-0", [5, 6, 7])
    assert (second.request_id, second.prompt_token_ids) == (f"{rid}-1", [8, 9])
    texts = [o.text for request in (first, second) for o in offline_outputs(reference_llm, request)]
    body = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (i, text, "length") for i, text in enumerate(texts)
    ]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the n choices of a prompt agree
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 12


async def test_streamed_completion_with_logprobs_matches_the_plain_answer(world, engine_worker):
    body = {
        "model": world.model,
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    plain = (await api_post(world, URL, body)).json()["choices"][0]

    response = await api_post(world, URL, {**body, "stream": True})

    raw = b"".join([c async for c in response.streaming_content]).decode()
    assert raw.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert {c["object"] for c in chunks} == {"text_completion"}
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == plain["text"]
    assert choices[-1]["finish_reason"] == "length"
    streamed = [c["logprobs"] for c in choices if c["logprobs"] and c["logprobs"]["tokens"]]
    tokens = [t for lp in streamed for t in lp["tokens"]]
    assert tokens == plain["logprobs"]["tokens"]
    assert len(tokens) == 3
    assert [x for lp in streamed for x in lp["token_logprobs"]] == plain["logprobs"]["token_logprobs"]
    # Greedy: the one top logprob asked for is the chosen token's own.
    for lp in streamed:
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert lp["top_logprobs"] == [{t: x} for t, x in zip(lp["tokens"], lp["token_logprobs"], strict=True)]
    # Offsets run over the choice's text so far, chunk after chunk.
    offsets = [o for lp in streamed for o in lp["text_offset"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert plain["logprobs"]["text_offset"] == offsets


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([], "prompt"), ([1, "a"], "prompt"), ([5000], "prompt"), (None, "prompt")],
)
async def test_bad_prompts_are_400(world, prompt, param):
    response = await api_post(world, URL, {"model": world.model, "prompt": prompt})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert await queued_requests(world.model) == []
