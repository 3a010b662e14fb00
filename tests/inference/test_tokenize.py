"""POST /tokenize and /detokenize in vLLM's shapes: the served model's tokenizer, as generation
uses it; authenticated, rate-limited and scoped to the caller's models like /v1."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from transformers import AutoTokenizer

from tenants.services import tenant_limits_update

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|eot_id|> there"}]


def post(world, path: str, body: dict, raw_key: str | None = None):
    return Client().post(
        path, json.dumps(body), content_type="application/json", headers=world.headers(raw_key)
    )


@pytest.fixture
def tokenizer(served_model_dir):
    return AutoTokenizer.from_pretrained(served_model_dir)


def test_tokenize_a_prompt_as_the_model_does(world, tokenizer):
    text = "def héllo(x): return '日本' + x"

    response = post(world, "/tokenize", {"model": world.model, "prompt": text})
    bare = post(world, "/tokenize", {"model": world.model, "prompt": text, "add_special_tokens": False})
    strs = post(world, "/tokenize", {"model": world.model, "prompt": text, "return_token_strs": True})

    assert response.status_code == 200
    assert response["x-request-id"] and response["x-ratelimit-remaining-requests"]
    expected = tokenizer.encode(text)
    assert response.json() == {
        "count": len(expected),
        "max_model_len": world.deployment.max_model_len,
        "tokens": expected,
        "token_strs": None,
    }
    assert bare.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False) != expected
    assert strs.json()["token_strs"] == tokenizer.convert_ids_to_tokens(expected)


def test_tokenize_messages_gives_what_a_chat_completion_would_queue(world, tokenizer):
    from engine.chat_template import chat_prompt_token_ids

    response = post(world, "/tokenize", {"model": world.model, "messages": MESSAGES})

    # Text that looks like a control token stays text there too.
    assert response.json()["tokens"] == chat_prompt_token_ids(tokenizer, MESSAGES)


def test_detokenize_round_trips(world, tokenizer):
    text = "The capital of France is Paris."
    ids = tokenizer.encode(text, add_special_tokens=False)

    response = post(world, "/detokenize", {"model": world.model, "tokens": ids})

    assert (response.status_code, response.json()) == (200, {"prompt": text})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x"}, "model"),
        ("/tokenize", {"model": "M"}, "prompt"),
        (
            "/tokenize",
            {"model": "M", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            "prompt",
        ),
        ("/tokenize", {"model": "M", "prompt": 5}, "prompt"),
        ("/tokenize", {"model": "M", "prompt": "x", "frobnicate": 1}, "frobnicate"),
        (
            "/tokenize",
            {"model": "M", "messages": MESSAGES, "add_generation_prompt": False},
            "add_generation_prompt",
        ),
        ("/detokenize", {"model": "M", "tokens": [-1]}, "tokens.0"),
        ("/detokenize", {"model": "M", "tokens": "abc"}, "tokens"),
        ("/detokenize", {"model": "M", "tokens": [10**9]}, "tokens"),
        # Found by the schema fuzzer (a 500 before): a role that is not a string.
        ("/tokenize", {"model": "M", "messages": [{"role": {}, "content": "x"}]}, "messages"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(world, path, body, param):
    body = {k: world.model if v == "M" else v for k, v in body.items()}
    response = post(world, path, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert response["x-request-id"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_key_is_needed_and_only_the_callers_models_are_tokenized(world, path):
    body = (
        {"model": world.model, "prompt": "x"}
        if path == "/tokenize"
        else {"model": world.model, "tokens": [1]}
    )

    anonymous = Client().post(path, json.dumps(body), content_type="application/json")
    outsider = post(world, path, body, raw_key=world.raw_key_b)

    assert (anonymous.status_code, anonymous.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (outsider.status_code, outsider.json()["error"]["code"]) == (404, "model_not_found")


def test_tokenize_counts_against_the_request_rate(world):
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=2)
    body = {"model": world.model, "prompt": "x"}

    statuses = [post(world, "/tokenize", body).status_code for _ in range(3)]

    assert statuses == [200, 200, 429]


def test_tokenize_answers_get_with_405_in_the_api_shape(world):
    response = Client().get("/tokenize", headers=world.headers())
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
