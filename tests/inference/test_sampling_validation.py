"""Sampling parameters have one validator, the engine's SamplingParams: the API refuses what it
refuses, with its message and the field named, before the prompt is tokenized; the OpenAPI schema
shows its ranges."""

from __future__ import annotations

import math

import pytest

from core.api.openapi import api_schema
from engine.rules import MAX_LOGIT_BIAS_ENTRIES
from engine.sampling_params import INTEGER_RANGES, NUMBER_RANGES, SamplingParams, SamplingParamsError
from inference import tokenization
from tests.helpers import api_post
from tests.inference.conftest import queued_requests

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _out_of_range() -> list[tuple[str, object]]:
    cases: list[tuple[str, object]] = []
    for name, (low, high, _) in NUMBER_RANGES.items():
        cases.append((name, low - 1 if not math.isfinite(high) else high + 1))
    for name, (ilow, ihigh) in INTEGER_RANGES.items():
        if name == "logprobs":  # the body's logprobs is each endpoint's own field (see below)
            continue
        cases.append((name, ihigh + 1 if ihigh is not None else ilow - 1))
    return cases + [
        ("stop", ["x"] * 5),
        ("stop", [""]),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"²": 1}),
        ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
    ]


@pytest.mark.parametrize(("name", "value"), _out_of_range())
@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
async def test_a_sampling_parameter_the_engine_refuses_is_a_400_with_its_message(
    world, monkeypatch, url, name, value
):
    def untokenized(*args, **kwargs):
        raise AssertionError("the prompt was tokenized for a request refused by its sampling parameters")

    monkeypatch.setattr(tokenization, "text_prompt_ids", untokenized)
    monkeypatch.setattr(tokenization, "chat_prompt_ids", untokenized)
    body = {"model": world.model, name: value}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if url == CHAT else {"prompt": "Hi"})

    refused = await api_post(world, url, body)

    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    with pytest.raises(SamplingParamsError) as engine:
        SamplingParams(**{name: value}, max_tokens=max(1, value if name == "min_tokens" else 1))
    assert (error["param"], error["message"]) == (engine.value.param, str(engine.value))
    assert await queued_requests(world.model) == []


async def test_min_tokens_above_the_requests_max_tokens_is_the_engines_refusal(world):
    refused = await api_post(
        world, COMPLETIONS, {"model": world.model, "prompt": "Hi", "max_tokens": 3, "min_tokens": 4}
    )

    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "min_tokens"
    assert refused.json()["error"]["message"] == "min_tokens (4) must be <= max_tokens (3)"


def test_the_schema_shows_the_engines_ranges():
    schemas = api_schema()["components"]["schemas"]
    for component in ("CreateChatCompletionRequest", "CreateCompletionRequest"):
        properties = schemas[component]["properties"]
        for name, (low, high, low_open) in NUMBER_RANGES.items():
            shown = properties[name]
            assert shown[("exclusiveMinimum" if low_open else "minimum")] == low, (component, name)
            assert shown.get("maximum") == (high if math.isfinite(high) else None), (component, name)
        for name in ("top_k", "seed", "n", "min_tokens", "prompt_logprobs"):
            low, high = INTEGER_RANGES[name]
            assert (properties[name].get("minimum"), properties[name].get("maximum")) == (low, high), name
