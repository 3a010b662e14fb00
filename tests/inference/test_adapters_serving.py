"""Serving tenant A's adapter by name on a real LoRA-enabled engine replica, and tenant B (the
outsider) who can neither see, use nor delete it. B may use the same base model, so tenancy is the
only thing between B and the adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient, Client

from engine.protocol import LoRARef
from inference.models import LoraAdapter
from inference.services.adapters import adapter_upload
from tenants.models import UsageRecord
from tenants.services import tenant_limits_update
from tests.helpers import api_post
from tests.inference.conftest import offline_adapter_outputs, offline_outputs, queued_requests
from tests.inference.peft_adapters import files_of, files_on_disk

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "support-tone"
URL = "/v1/chat/completions"


@pytest.fixture
def adapter(world, adapters_dir, media_root, celery_eager) -> LoraAdapter:
    """A's ready adapter on the world's model, which B is allowed here to use too."""
    tenant_limits_update(tenant=world.tenant_b, allowed_models=[world.model])
    adapter = adapter_upload(
        tenant=world.tenant_a, name=NAME, base_model=world.model, files=files_of(adapters_dir["good"])
    )
    adapter.refresh_from_db()
    assert adapter.status == "ready"
    return adapter


def chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi there"}], **extra}


# Greedy and exactly MAX_TOKENS long, so answers compare token for token and usage is known.
GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


async def test_chat_naming_the_adapter_is_served_with_its_weights_on_the_base_model(
    world, adapter, lora_engine_worker, reference_llm
):
    response = await api_post(world, URL, chat_body(NAME, **GREEDY))

    assert response.status_code == 200
    [request] = await queued_requests(world.model)
    assert request.model == world.model
    assert request.lora == LoRARef(name=NAME, path=adapter.storage_path, version=adapter.version)
    assert sorted(p.name for p in Path(request.lora.path).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert request.cache_salt == f"tenant:{world.tenant_a.id}"
    [tuned] = await sync_to_async(offline_adapter_outputs)(world.deployment.model_path, request)
    [base] = offline_outputs(reference_llm, request)
    assert len(tuned.token_ids) == len(base.token_ids) == 5
    assert tuned.token_ids != base.token_ids  # the adapter's weights reached the forward pass
    body = response.json()
    assert body["model"] == NAME
    assert body["choices"][0]["message"]["content"] == tuned.text != base.text
    assert body["usage"]["completion_tokens"] == 5
    rows = await sync_to_async(list)(
        UsageRecord.objects.values_list("request_id", "model", "adapter", "status", "completion_tokens")
    )
    assert rows == [(response["x-request-id"], world.model, NAME, "success", 5)]


async def test_streamed_completion_naming_the_adapter_echoes_its_name(world, adapter, lora_engine_worker):
    response = await AsyncClient().post(
        "/v1/completions",
        json.dumps({"model": NAME, "prompt": "Hi", "stream": True, **GREEDY}),
        content_type="application/json",
        headers=world.headers(),
    )

    assert response.status_code == 200
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    [request] = await queued_requests(world.model)
    assert request.lora is not None and request.lora.name == NAME
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {NAME}
    [tuned] = await sync_to_async(offline_adapter_outputs)(world.deployment.model_path, request)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == tuned.text


async def test_requests_with_the_base_model_carry_no_adapter(
    world, adapter, lora_engine_worker, reference_llm
):
    response = await api_post(world, URL, chat_body(world.model, **GREEDY))

    assert response.status_code == 200
    [request] = await queued_requests(world.model)
    assert request.lora is None
    [base] = offline_outputs(reference_llm, request)
    assert response.json()["model"] == world.model
    assert response.json()["choices"][0]["message"]["content"] == base.text
    assert await sync_to_async(list)(UsageRecord.objects.values_list("adapter", flat=True)) == [None]


async def test_metrics_count_requests_per_adapter(world, adapter, lora_engine_worker, operator_headers):
    response = await api_post(world, URL, chat_body(NAME, **GREEDY))
    assert response.status_code == 200
    [request] = await queued_requests(world.model)

    text = (await AsyncClient().get("/metrics", headers=operator_headers)).content.decode()

    labels = f'adapter="{NAME}",model="{world.model}"'
    assert (
        f'pagoda_adapter_requests_total{{{labels},status="success",tenant="{world.tenant_a.slug}"}} 1.0'
        in text
    )
    tokens = len(request.prompt_token_ids) + 5
    assert f'pagoda_adapter_tokens_total{{{labels},tenant="{world.tenant_a.slug}"}} {float(tokens)}' in text


async def test_outsider_using_the_adapter_name_gets_model_not_found_like_a_missing_model(world, adapter):
    await world.faults.heartbeat()

    outsider = await api_post(world, URL, chat_body(NAME), raw_key=world.raw_key_b)
    await sync_to_async(LoraAdapter.objects.all().delete)()
    missing = await api_post(world, URL, chat_body(NAME))

    expected = {
        "error": {
            "message": f"The model `{NAME}` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert (outsider.status_code, outsider.json()) == (404, expected)
    assert (missing.status_code, missing.json()) == (404, expected)
    assert await world.faults.queued_count() == 0
    assert await sync_to_async(UsageRecord.objects.count)() == 0


async def test_adapters_that_are_not_ready_cannot_be_used(world, adapter):
    await world.faults.heartbeat()
    for status in ("uploaded", "validating", "failed"):
        await LoraAdapter.objects.filter(pk=adapter.pk).aupdate(status=status)

        response = await api_post(world, URL, chat_body(NAME))

        assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")
    assert await world.faults.queued_count() == 0


async def test_adapter_on_a_base_model_the_key_may_not_use_cannot_be_used(world, adapter):
    await world.faults.heartbeat()
    await sync_to_async(tenant_limits_update)(tenant=world.tenant_a, allowed_models=["b-only-model"])

    response = await api_post(world, URL, chat_body(NAME))

    assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")
    models = await AsyncClient().get("/v1/models", headers=world.headers())
    assert models.json()["data"] == []


async def test_models_lists_the_callers_ready_adapters_with_their_parent(world, adapter):
    mine = await AsyncClient().get("/v1/models", headers=world.headers())
    theirs = await AsyncClient().get("/v1/models", headers=world.headers(world.raw_key_b))

    assert mine.json()["data"] == [
        {
            "id": world.model,
            "object": "model",
            "created": int(world.deployment.created_at.timestamp()),
            "owned_by": "pagoda",
        },
        {
            "id": NAME,
            "object": "model",
            "created": int(adapter.created_at.timestamp()),
            "owned_by": world.tenant_a.slug,
            "parent": world.model,
        },
    ]
    assert [m["id"] for m in theirs.json()["data"]] == [world.model]

    await LoraAdapter.objects.filter(pk=adapter.pk).aupdate(status="failed")
    mine = await AsyncClient().get("/v1/models", headers=world.headers())
    assert [m["id"] for m in mine.json()["data"]] == [world.model]


async def test_models_retrieve_answers_as_the_list_and_hides_other_tenants_adapters(world, adapter):
    listed = (await AsyncClient().get("/v1/models", headers=world.headers())).json()["data"]

    base = await AsyncClient().get(f"/v1/models/{world.model}", headers=world.headers())
    named = await AsyncClient().get(f"/v1/models/{NAME}", headers=world.headers())
    theirs = await AsyncClient().get(f"/v1/models/{NAME}", headers=world.headers(world.raw_key_b))
    missing = await AsyncClient().get("/v1/models/org/no-such-model", headers=world.headers())

    assert [base.json(), named.json()] == listed
    assert base["x-request-id"] and named["x-ratelimit-remaining-requests"]
    for refused, name in ((theirs, NAME), (missing, "org/no-such-model")):
        assert refused.status_code == 404
        assert refused.json()["error"] == {
            "message": f"The model `{name}` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }


def test_outsider_cannot_see_the_adapter(world, adapter):
    listing = Client().get("/v1/adapters", headers=world.headers(world.raw_key_b))
    detail = Client().get(f"/v1/adapters/{NAME}", headers=world.headers(world.raw_key_b))
    own = Client().get(f"/v1/adapters/{NAME}", headers=world.headers())

    assert (listing.status_code, listing.json()) == (200, {"object": "list", "data": []})
    assert detail.status_code == 404
    assert detail.json()["error"] == {
        "message": f"The adapter `{NAME}` does not exist.",
        "type": "invalid_request_error",
        "param": "name",
        "code": "adapter_not_found",
    }
    assert (own.status_code, own.json()["id"], own.json()["status"]) == (200, NAME, "ready")


def test_outsider_cannot_delete_the_adapter(world, adapter, media_root):
    on_disk = files_on_disk(media_root)

    response = Client().delete(f"/v1/adapters/{NAME}", headers=world.headers(world.raw_key_b))
    missing = Client().delete("/v1/adapters/no-such-adapter", headers=world.headers())

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "adapter_not_found"
    assert missing.json()["error"]["code"] == "adapter_not_found"
    assert LoraAdapter.objects.filter(pk=adapter.pk).exists()
    assert files_on_disk(media_root) == on_disk != []


def test_owner_deletes_the_adapter_with_its_files(world, adapter, media_root):
    response = Client().delete(f"/v1/adapters/{NAME}", headers=world.headers())

    assert (response.status_code, response.json()) == (
        200,
        {"id": NAME, "object": "adapter", "deleted": True},
    )
    assert LoraAdapter.objects.count() == 0
    assert files_on_disk(media_root) == []
    assert not (media_root / "adapters" / world.tenant_a.slug).exists()
