"""Bounds on what one request may make the web tier tokenize: /detokenize's id lists, /tokenize's
text, and prompts that could not fit the context even in their most compact tokenization, refused
by their byte length before they are tokenized, with the same 400 the full check gives."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from django.test import Client
from transformers import AutoTokenizer

from inference import tokenization
from inference.api.tokens import MAX_DETOKENIZE_TOKENS
from tenants.models import UsageRecord
from tests.helpers import api_post
from tests.inference.conftest import MAX_MODEL_LEN, queued_requests

pytestmark = pytest.mark.django_db(transaction=True)


def post(world, path: str, body: dict):
    return Client().post(path, json.dumps(body), content_type="application/json", headers=world.headers())


def test_detokenize_refuses_more_ids_than_its_bound_before_reading_them(world):
    response = post(world, "/detokenize", {"model": world.model, "tokens": [1] * (MAX_DETOKENIZE_TOKENS + 1)})

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tokens" and str(MAX_DETOKENIZE_TOKENS) in error["message"]


def test_detokenize_refuses_more_ids_than_the_context_holds(world):
    refused = post(world, "/detokenize", {"model": world.model, "tokens": [1] * (MAX_MODEL_LEN + 1)})
    served = post(world, "/detokenize", {"model": world.model, "tokens": [1] * MAX_MODEL_LEN})

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "tokens" and f"At most {MAX_MODEL_LEN} token ids" in error["message"]
    assert served.status_code == 200


def test_a_token_never_stands_for_more_bytes_than_the_bound(world, served_model_dir):
    per_token = tokenization.max_token_bytes(str(served_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)

    spans = [len(tokenizer.decode([i]).encode()) for i in range(len(tokenizer))]

    assert per_token is not None and max(spans) <= per_token
    # The bound is tight for a byte-level vocabulary: some token reaches it.
    assert max(spans) == per_token


@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_tokenize_refuses_text_that_no_tokenization_fits_in_the_context(world, served_model_dir, field):
    per_token = tokenization.max_token_bytes(str(served_model_dir))
    text = "a" * (MAX_MODEL_LEN * per_token + 1)
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}

    response = post(world, "/tokenize", {"model": world.model, **body})

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == field
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "bytes) make at least" in error["message"]
    if field == "prompt":
        assert f"the prompt ({len(text)} bytes) make at least {MAX_MODEL_LEN + 1} tokens" in error["message"]


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 16}, "prompt"),
        ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
    ],
)
async def test_a_prompt_that_cannot_fit_is_refused_by_its_length_before_tokenization(
    world, served_model_dir, url, body, param
):
    per_token = tokenization.max_token_bytes(str(served_model_dir))
    text = "é" * (MAX_MODEL_LEN * per_token)  # two bytes a character

    response = await api_post(world, url, {"model": world.model, **body(text)})

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "bytes) make at least" in error["message"]
    assert await queued_requests(world.model) == []
    assert await sync_to_async(UsageRecord.objects.count)() == 0
