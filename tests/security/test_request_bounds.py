"""One request's work is bounded before anything is looked up, tokenized, queued or billed."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from engine.rules import MAX_COMPLETION_PROMPTS, MAX_SEQUENCES_PER_REQUEST, MAX_STOP_STRING_CHARS
from tenants.models import UsageRecord
from tests.inference.conftest import queued_requests

pytestmark = pytest.mark.django_db(transaction=True)


def _post(world, path: str, body: dict):
    return Client().post(path, json.dumps(body), content_type="application/json", headers=world.headers())


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"prompt": ["x"] * (MAX_COMPLETION_PROMPTS + 1)}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2]] * (MAX_COMPLETION_PROMPTS + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["x", "y"], "n": MAX_SEQUENCES_PER_REQUEST // 2 + 1}, "n"),
        ("/v1/completions", {"prompt": "x", "stop": ["s" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ],
)
async def test_requests_over_their_bounds_are_refused_before_anything_is_queued(world, path, extra, param):
    from asgiref.sync import sync_to_async

    response = await sync_to_async(_post)(world, path, {"model": world.model, "max_tokens": 2, **extra})

    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert await queued_requests(world.model) == []
    assert not await UsageRecord.objects.aexists()


def test_requests_at_their_bounds_pass_validation(world):
    # The name of a model nobody serves: a 404 proves the body itself was accepted.
    bodies = [
        {"prompt": ["x"] * MAX_COMPLETION_PROMPTS, "n": MAX_SEQUENCES_PER_REQUEST // MAX_COMPLETION_PROMPTS},
        {"prompt": "x", "stop": ["s" * MAX_STOP_STRING_CHARS] * 4},
    ]
    for body in bodies:
        response = _post(world, "/v1/completions", {"model": "nobody-serves-this", **body})
        assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")
