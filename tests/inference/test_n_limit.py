"""`n` is refused by the web tier above the sequences a deployment's engines run for one request
(engine.rules.max_seqs_per_request of its engine_settings: a quarter of max_num_seqs by default),
before anything is queued or billed."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from tenants.models import UsageRecord
from tests.inference.conftest import queued_requests

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
COMPLETION = ("/v1/completions", {"prompt": "x"})


def _post(world, path: str, body: dict):
    return Client().post(path, json.dumps(body), content_type="application/json", headers=world.headers())


@pytest.mark.parametrize(("path", "body"), [CHAT, COMPLETION])
async def test_n_over_a_quarter_of_the_default_slots_is_a_400_naming_n_and_the_limit(world, path, body):
    response = await sync_to_async(_post)(
        world, path, {"model": world.model, "max_tokens": 2, **body, "n": 33}
    )

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == ("n", "invalid_request_error")
    assert "at most 32" in error["message"]
    assert await queued_requests(world.model) == []
    assert not await UsageRecord.objects.aexists()


@pytest.mark.world(deployment={"engine_settings": {"max_num_seqs": 16}})
@pytest.mark.parametrize(("path", "body"), [CHAT, COMPLETION])
async def test_the_limit_follows_the_deployments_engine_settings(world, path, body):
    response = await sync_to_async(_post)(
        world, path, {"model": world.model, "max_tokens": 2, **body, "n": 5}
    )

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert "at most 4" in response.json()["error"]["message"]
    assert await queued_requests(world.model) == []


@pytest.mark.world(deployment={"engine_settings": {"max_num_seqs": 16, "max_seqs_per_request": 6}})
async def test_an_explicit_limit_is_the_one_applied_and_n_at_it_is_queued(world):
    path, body = COMPLETION
    refused = await sync_to_async(_post)(world, path, {"model": world.model, "max_tokens": 2, **body, "n": 7})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "n")
    assert await queued_requests(world.model) == []

    # No engine runs here: n at the limit passes the plan and gets as far as the replica's readiness.
    accepted = await sync_to_async(_post)(
        world, path, {"model": world.model, "max_tokens": 2, **body, "n": 6}
    )
    assert accepted.status_code == 503 and accepted.json()["error"]["param"] != "n"
