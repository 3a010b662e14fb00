"""GET /v1/models, /ready per model, /metrics, and the deployment admin's replica table."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.contrib.auth import get_user_model
from django.test import AsyncClient, Client

from inference.models import ModelDeployment

pytestmark = pytest.mark.django_db(transaction=True)


async def test_models_lists_only_enabled_models_the_key_may_use(world):
    await ModelDeployment.objects.acreate(name="b-only-model", model_path="/x", max_model_len=16)
    response = await AsyncClient().get("/v1/models", headers=world.headers())
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [world.model]
    assert response.json()["object"] == "list"
    assert response.json()["data"][0]["object"] == "model"

    other = await AsyncClient().get("/v1/models", headers=world.headers(world.raw_key_b))
    assert [m["id"] for m in other.json()["data"]] == ["b-only-model"]

    world.deployment.enabled = False
    await world.deployment.asave()
    response = await AsyncClient().get("/v1/models", headers=world.headers())
    assert response.json()["data"] == []


async def test_models_without_a_key_is_401():
    response = await AsyncClient().get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_wrong_method_is_405_in_openai_shape(world):
    response = await AsyncClient().get("/v1/chat/completions", headers=world.headers())
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


async def test_ready_is_503_for_an_enabled_model_without_a_live_replica(world):
    response = await AsyncClient().get("/ready")
    assert response.status_code == 503
    assert response.json()["models"][world.model] == {"ready": False, "replicas": []}
    assert world.model in response.json()["checks"]["engines"]

    await world.engine.heartbeat(num_running=2)
    response = await AsyncClient().get("/ready")
    assert response.status_code == 200
    [replica] = response.json()["models"][world.model]["replicas"]
    assert (replica["replica_id"], replica["num_running"]) == ("fake-1", 2)


async def test_metrics_count_per_tenant_and_read_engine_gauges_from_heartbeats(world):
    await world.engine.heartbeat(num_running=3, kv_cache_usage=0.25)
    served = asyncio.create_task(world.engine.serve_one([("ab", [1, 2])], cached_tokens=1))
    await AsyncClient().post(
        "/v1/chat/completions",
        json.dumps({"model": world.model, "messages": [{"role": "user", "content": "Hi"}]}),
        content_type="application/json",
        headers=world.headers(),
    )
    await served
    await AsyncClient().post(
        "/v1/chat/completions",
        json.dumps({"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}),
        content_type="application/json",
        headers=world.headers(),
    )

    text = (await AsyncClient().get("/metrics")).content.decode()

    # prometheus_client writes label pairs sorted by name.
    labels = f'model="{world.model}",tenant="{world.tenant_a.slug}"'
    assert f'pagoda_requests_total{{model="{world.model}",status="success",tenant="{world.tenant_a.slug}"}} 1.0' in text
    assert f"pagoda_completion_tokens_total{{{labels}}} 2.0" in text
    assert f"pagoda_cached_tokens_total{{{labels}}} 1.0" in text
    assert f"pagoda_time_to_first_token_seconds_count{{{labels}}} 1.0" in text
    assert f"pagoda_e2e_request_latency_seconds_count{{{labels}}} 1.0" in text
    # An unknown model name is not a label value: it cannot mint new series.
    assert f'pagoda_request_errors_total{{code="model_not_found",model="-",tenant="{world.tenant_a.slug}"}}' in text
    assert f'pagoda_engine_running_requests{{model="{world.model}"}} 3.0' in text
    assert f'pagoda_engine_kv_cache_usage{{model="{world.model}"}} 0.25' in text
    assert f'pagoda_engine_replicas{{model="{world.model}"}} 1.0' in text
    assert "request_id" not in text


def test_admin_shows_live_replicas(world):
    from asgiref.sync import async_to_sync

    async_to_sync(world.engine.heartbeat)(num_running=4, prefix_cache_hit_rate=0.5)
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(admin)
    page = client.get(f"/admin/inference/modeldeployment/{world.deployment.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    i = html.lower().find("replica")
    assert "fake-1" in html
    assert "<td>4</td>" in html
    assert "50.0%" in html
    listing = client.get("/admin/inference/modeldeployment/")
    assert listing.status_code == 200
