"""/v1/completions `echo` (with the prompt's logprobs, as lm-evaluation-harness scores answers) and
vLLM's `prompt_logprobs` extra, served from the same forward passes as the completion."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from engine.sampling_params import SamplingParams
from inference.tokenization import get_tokenizer, text_prompt_ids, token_text
from tests.helpers import api_post
from tests.inference.conftest import queued_requests

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/completions"
PROMPT = "Question: which colour is the sky? Answer: blue"


def _offline_prompt_logprobs(reference_llm, prompt_ids: list[int], k: int):
    [out] = reference_llm.generate(
        [prompt_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
    )
    return out


async def test_echo_prepends_the_prompt_and_scores_its_tokens(world, engine_worker, reference_llm):
    body = {
        "model": world.model,
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
    }

    response = await api_post(world, URL, body)

    assert response.status_code == 200, response.content
    [request] = await queued_requests(world.model)
    prompt_ids = await sync_to_async(text_prompt_ids)(world.deployment.model_path, PROMPT)
    assert request.prompt_token_ids == prompt_ids
    assert request.sampling_params["prompt_logprobs"] == 2
    offline = await sync_to_async(_offline_prompt_logprobs)(reference_llm, prompt_ids, 2)
    [choice] = response.json()["choices"]
    assert choice["text"] == PROMPT + offline.outputs[0].text
    logprobs = choice["logprobs"]
    path = world.deployment.model_path
    expected_tokens = [token_text(path, t) for t in [*prompt_ids, *offline.outputs[0].token_ids]]
    assert logprobs["tokens"] == expected_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for got, entry in zip(
        logprobs["token_logprobs"][1 : len(prompt_ids)], offline.prompt_logprobs[1:], strict=True
    ):
        assert got == pytest.approx(entry.logprob, abs=1e-5)
    for got, entry in zip(
        logprobs["top_logprobs"][1 : len(prompt_ids)], offline.prompt_logprobs[1:], strict=True
    ):
        assert list(got) == [token_text(path, t) for t, _ in entry.top_logprobs]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert offsets == [sum(len(t) for t in expected_tokens[:i]) for i in range(len(expected_tokens))]
    assert response.json()["usage"]["prompt_tokens"] == len(prompt_ids)


async def test_echo_without_logprobs_only_prepends_the_prompt(world, engine_worker):
    plain = await api_post(
        world, URL, {"model": world.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    )
    echoed = await api_post(
        world, URL, {"model": world.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True}
    )

    assert echoed.json()["choices"][0]["text"] == PROMPT + plain.json()["choices"][0]["text"]
    assert echoed.json()["choices"][0]["logprobs"] is None
    assert "prompt_logprobs" not in (await queued_requests(world.model))[1].sampling_params


async def test_echo_of_token_id_prompts_decodes_them_per_prompt(world, engine_worker):
    tokenizer = await sync_to_async(get_tokenizer)(world.deployment.model_path)
    prompts = [tokenizer.encode("Once upon a time"), tokenizer.encode("The end")]

    response = await api_post(
        world,
        URL,
        {"model": world.model, "prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True, "n": 2},
    )

    texts = [c["text"] for c in response.json()["choices"]]
    assert [t.startswith(tokenizer.decode(prompts[i // 2])) for i, t in enumerate(texts)] == [True] * 4


async def test_prompt_logprobs_extra_has_vllms_shape_on_both_endpoints(world, engine_worker, reference_llm):
    prompt_ids = await sync_to_async(text_prompt_ids)(world.deployment.model_path, PROMPT)
    completion = await api_post(
        world,
        URL,
        {"model": world.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},
    )
    chat = await api_post(
        world,
        "/v1/chat/completions",
        {
            "model": world.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
    )

    offline = await sync_to_async(_offline_prompt_logprobs)(reference_llm, prompt_ids, 1)
    scored = completion.json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt_ids)
    for token, got, entry in zip(prompt_ids[1:], scored[1:], offline.prompt_logprobs[1:], strict=True):
        assert got[str(token)]["logprob"] == pytest.approx(entry.logprob, abs=1e-5)
        assert got[str(token)]["rank"] == entry.rank
        top_token = str(entry.top_logprobs[0][0])
        assert got[top_token]["rank"] == 1
    chat_scored = chat.json()["prompt_logprobs"]
    [chat_request] = [
        r for r in await queued_requests(world.model) if r.sampling_params.get("prompt_logprobs") == 0
    ]
    assert chat_scored[0] is None and len(chat_scored) == len(chat_request.prompt_token_ids)
    assert all(
        list(entry) == [str(t)]
        for entry, t in zip(chat_scored[1:], chat_request.prompt_token_ids[1:], strict=True)
    )


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (URL, {"prompt": "x", "echo": True, "stream": True}, "echo"),
        (URL, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (URL, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1},
            "prompt_logprobs",
        ),
    ],
)
async def test_unsupported_combinations_are_400_naming_the_field(world, path, extra, param):
    response = await api_post(world, path, {"model": world.model, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert await queued_requests(world.model) == []


async def test_max_tokens_zero_with_echo_scores_the_prompt_and_bills_no_completion(
    world, engine_worker, reference_llm
):
    from tenants.models import UsageRecord

    body = {"model": world.model, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}

    response = await api_post(world, URL, body)

    assert response.status_code == 200, response.content
    prompt_ids = await sync_to_async(text_prompt_ids)(world.deployment.model_path, PROMPT)
    offline = await sync_to_async(_offline_prompt_logprobs)(reference_llm, prompt_ids, 0)
    [choice] = response.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
    for got, entry in zip(choice["logprobs"]["token_logprobs"][1:], offline.prompt_logprobs[1:], strict=True):
        assert got == pytest.approx(entry.logprob, abs=1e-5)
    assert response.json()["usage"]["completion_tokens"] == 0
    row = await UsageRecord.objects.aget(request_id=response["x-request-id"])
    assert (row.prompt_tokens, row.completion_tokens) == (len(prompt_ids), 0)


async def test_max_tokens_zero_needs_echo(world):
    response = await api_post(world, URL, {"model": world.model, "prompt": "x", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
