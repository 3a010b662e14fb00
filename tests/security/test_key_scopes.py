"""Scoped keys: what a key may call (its scope) and which models (its model list), over REST, SSE
and the websocket, against a real engine replica. A refusal is OpenAI-shaped, names what is missing,
and writes, queues and bills nothing."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient

from batches.models import Batch, File
from config.asgi import application
from inference.models import LoraAdapter
from tenants.models import ApiKey, UsageRecord
from tenants.services import api_key_create
from tests.helpers import api_post
from tests.inference.conftest import queued_requests

pytestmark = pytest.mark.django_db(transaction=True)

# (method, path, body) of every management endpoint: each needs the "manage" scope.
MANAGEMENT = [
    ("get", "/v1/files", None),
    ("post", "/v1/files", {"purpose": "batch"}),
    ("get", "/v1/files/file-abc", None),
    ("get", "/v1/files/file-abc/content", None),
    ("delete", "/v1/files/file-abc", None),
    ("get", "/v1/batches", None),
    ("post", "/v1/batches", {"input_file_id": "file-abc", "endpoint": "/v1/chat/completions"}),
    ("get", "/v1/batches/batch_abc", None),
    ("post", "/v1/batches/batch_abc/cancel", {}),
    ("get", "/v1/adapters", None),
    ("post", "/v1/adapters", {"name": "x"}),
    ("get", "/v1/adapters/x", None),
    ("delete", "/v1/adapters/x", None),
    ("get", "/v1/usage", None),
]


async def _key(world, **options) -> str:
    _, raw_key = await sync_to_async(api_key_create)(tenant=world.tenant_a, name="scoped", **options)
    return raw_key


async def _call(method: str, path: str, body: dict | None, raw_key: str):
    client = AsyncClient()
    headers = {"Authorization": f"Bearer {raw_key}"}
    if method == "get":
        return await client.get(path, headers=headers)
    if method == "delete":
        return await client.delete(path, headers=headers)
    return await client.post(path, json.dumps(body), content_type="application/json", headers=headers)


def _chat(world, **extra) -> dict:
    return {"model": world.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}


async def _websocket_chat(world, raw_key: str) -> list[dict]:
    """The messages of one chat over the websocket, up to its end (done or error)."""
    communicator = WebsocketCommunicator(application, "/ws/v1/chat", subprotocols=["pagoda.v1"])
    assert (await communicator.connect())[0]
    await communicator.send_json_to({"type": "auth", "api_key": raw_key})
    assert await communicator.receive_json_from(timeout=10) == {"type": "authenticated"}
    await communicator.send_json_to({"type": "chat", "id": "s1", "request": _chat(world)})
    messages = []
    while not messages or messages[-1]["type"] not in ("done", "error"):
        messages.append(await communicator.receive_json_from(timeout=60))
    await communicator.disconnect()
    return messages


async def _nothing_written() -> None:
    assert not await File.objects.aexists()
    assert not await Batch.objects.aexists()
    assert not await LoraAdapter.objects.aexists()


@pytest.mark.parametrize(("method", "path", "body"), MANAGEMENT)
async def test_an_inference_key_is_refused_every_management_endpoint_naming_the_scope(
    world, method, path, body
):
    raw_key = await _key(world, scope=ApiKey.Scope.INFERENCE)

    response = await _call(method, path, body, raw_key)

    assert response.status_code == 403
    assert response["x-ratelimit-remaining-requests"]  # counted, as every refused request is
    assert response.json() == {
        "error": {
            "message": f"This API key lacks the 'manage' scope that {method.upper()} {path} needs "
            "(it has: inference).",
            "type": "invalid_request_error",
            "param": None,
            "code": "permission_denied",
        }
    }
    await _nothing_written()


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches", "/v1/adapters", "/v1/usage"])
async def test_a_key_of_the_default_scope_reaches_the_management_endpoints(world, path):
    raw_key = await _key(world)

    response = await _call("get", path, None, raw_key)

    assert response.status_code == 200


async def test_an_inference_key_generates_over_rest_sse_and_the_websocket(world, engine_worker):
    raw_key = await _key(world, scope=ApiKey.Scope.INFERENCE)

    plain = await api_post(world, "/v1/chat/completions", _chat(world), raw_key=raw_key)
    streamed = await api_post(world, "/v1/chat/completions", _chat(world, stream=True), raw_key=raw_key)
    events = b"".join([chunk async for chunk in streamed.streaming_content]).decode()
    socket = await _websocket_chat(world, raw_key)
    models = await AsyncClient().get("/v1/models", headers={"Authorization": f"Bearer {raw_key}"})

    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert streamed.status_code == 200 and events.rstrip().endswith("data: [DONE]")
    assert socket[-1]["type"] == "done"
    assert [m["id"] for m in models.json()["data"]] == [world.model]
    assert await UsageRecord.objects.filter(api_key__prefix=raw_key[3:15]).acount() == 3


async def test_a_key_without_the_model_is_refused_it_over_rest_sse_and_the_websocket(world, engine_worker):
    raw_key = await _key(world, allowed_models=["some-other-model"])

    plain = await api_post(world, "/v1/chat/completions", _chat(world), raw_key=raw_key)
    streamed = await api_post(world, "/v1/chat/completions", _chat(world, stream=True), raw_key=raw_key)
    socket = await _websocket_chat(world, raw_key)
    models = await AsyncClient().get("/v1/models", headers={"Authorization": f"Bearer {raw_key}"})

    refusal = plain.json()["error"]
    assert plain.status_code == streamed.status_code == 404
    assert streamed.json()["error"] == refusal and refusal["code"] == "model_not_found"
    assert socket[-1]["type"] == "error" and socket[-1]["error"]["code"] == "model_not_found"
    assert models.json()["data"] == []
    assert await queued_requests(world.model) == []
    assert not await UsageRecord.objects.aexists()
