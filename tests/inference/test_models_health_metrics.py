"""GET /v1/models, /ready per model, /metrics, and the deployment admin's replica table, with a real
engine replica publishing its heartbeats."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth import get_user_model
from django.test import AsyncClient, Client

from core.redis_client import get_redis
from inference.gateway import live_replica_set_async
from inference.gateway.replicas import LIVE_SET_MAX_AGE_S
from inference.models import ModelDeployment
from tests.helpers import async_wait_until
from tests.inference.conftest import NUM_BLOCKS
from tests.inference.fault_injection import ProtocolFaultInjector

pytestmark = pytest.mark.django_db(transaction=True)

# Long enough for several full KV blocks of 16 tokens.
LONG = (
    "Summarize the following notes about the harbor, the lighthouse, the ferry timetable and the fish market. "
    * 2
)


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


async def test_ready_is_503_for_an_enabled_model_without_a_live_replica(world, operator_headers):
    response = await AsyncClient().get("/ready", headers=operator_headers)
    assert response.status_code == 503
    assert response.json()["models"][world.model] == {
        "ready": False,
        "replicas": [],
        "replica_wait_seconds": 0,
    }
    assert world.model in response.json()["checks"]["engines"]


async def test_ready_for_the_web_scope_leaves_a_model_without_engines_out(world, operator_headers):
    """What a web Deployment's readiness probe reads: one model without engines must not take every
    web process, and with them every other model, out of the load balancer."""
    response = await AsyncClient().get("/ready?scope=web", headers=operator_headers)
    anonymous = await AsyncClient().get("/ready?scope=web")
    unknown = await AsyncClient().get("/ready?scope=engines")

    assert response.status_code == 200
    assert response.json() == {
        "status": "ready",
        "checks": {"web": "ok", "database": "ok", "redis": "ok"},
        "models": {},
    }
    assert (anonymous.status_code, anonymous.json()) == (200, {"status": "ready"})
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (400, "scope")


async def test_ready_lists_the_live_engine_replica_of_each_model(world, engine_worker, operator_headers):
    response = await AsyncClient().get("/ready", headers=operator_headers)
    assert response.status_code == 200
    model = response.json()["models"][world.model]
    assert model["ready"] is True
    [replica] = model["replicas"]
    assert (replica["replica_id"], replica["num_running"]) == (engine_worker.settings.replica_id, 0)


async def test_a_model_whose_only_live_replica_is_draining_is_live_for_its_requests_but_not_ready(
    world, operator_headers
):
    from inference.gateway import live_replica_ids_async, ready_replica_ids, ready_replica_ids_async
    from tests.inference.fault_injection import ProtocolFaultInjector

    await world.faults.heartbeat(draining=True)

    response = await AsyncClient().get("/ready", headers=operator_headers)

    assert response.status_code == 503
    model = response.json()["models"][world.model]
    assert model["ready"] is False
    assert [(r["replica_id"], r["draining"]) for r in model["replicas"]] == [(world.faults.replica_id, True)]
    assert response.json()["checks"]["engines"] == f"only draining engine replicas for: {world.model}"
    # Requests it holds keep it as live; new ones must not count on it.
    assert await live_replica_ids_async(world.model) == [world.faults.replica_id]
    assert await ready_replica_ids_async(world.model) == []
    assert await sync_to_async(ready_replica_ids)(world.model) == []

    other = ProtocolFaultInjector(world.model, replica_id="fault-injector-2")
    await other.heartbeat()
    response = await AsyncClient().get("/ready", headers=operator_headers)

    assert (response.status_code, response.json()["models"][world.model]["ready"]) == (200, True)
    assert await ready_replica_ids_async(world.model) == ["fault-injector-2"]
    assert sorted(await live_replica_ids_async(world.model)) == [world.faults.replica_id, "fault-injector-2"]


async def test_ready_admission_and_the_engine_health_check_give_one_answer(world, operator_headers):
    """A replica whose heartbeat is fresh but whose stats this process cannot decode (a newer
    engine's) is ready for admission; /ready and engine_alive say the same, not "no replica"."""
    from django.core.management import call_command

    from engine.protocol import replica_stats_key
    from inference.gateway import ready_replica_ids_async

    await world.faults.heartbeat()
    key = replica_stats_key(world.faults.prefix, world.model, world.faults.replica_id)
    await sync_to_async(get_redis().set)(key, b'{"v": 999, "whatever": true}', ex=30)

    assert await ready_replica_ids_async(world.model) == [world.faults.replica_id]
    response = await AsyncClient().get("/ready", headers=operator_headers)
    assert response.status_code == 200, response.json()
    assert response.json()["models"][world.model]["ready"] is True
    out = io.StringIO()
    await sync_to_async(call_command)("engine_alive", "--model", world.model, stdout=out)
    assert out.getvalue() == f"1 live replica(s) for {world.model}, 1 ready (not draining)\n"

    await world.faults.heartbeat(draining=True)
    out = io.StringIO()
    await sync_to_async(call_command)("engine_alive", "--model", world.model, stdout=out)
    assert out.getvalue() == f"1 live replica(s) for {world.model}, 0 ready (not draining)\n"
    assert (await AsyncClient().get("/ready", headers=operator_headers)).status_code == 503


async def _heartbeat_matching(worker) -> object:
    """The replica's own stats, once its published heartbeat shows them (it beats every 0.2 s)."""
    from inference.selectors import deployment_replicas

    async def matching() -> object:
        stats = worker.stats()
        [published] = await sync_to_async(deployment_replicas)(name=worker.settings.model)
        if (published.num_running, published.prefix_cache_hit_rate) == (0, stats.prefix_cache_hit_rate):
            return published
        return None

    return await async_wait_until(matching, timeout=5, what="the replica's heartbeat to show it idle")


async def test_metrics_count_per_tenant_and_read_engine_gauges_from_heartbeats(
    world, engine_worker, operator_headers
):
    body = {
        "model": world.model,
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    answers = []
    for _ in range(2):  # the second finds the first one's prompt blocks cached
        response = await AsyncClient().post(
            "/v1/chat/completions", json.dumps(body), content_type="application/json", headers=world.headers()
        )
        answers.append(response.json())
    await AsyncClient().post(
        "/v1/chat/completions",
        json.dumps({"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}),
        content_type="application/json",
        headers=world.headers(),
    )
    cached = answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    stats = await _heartbeat_matching(engine_worker)
    assert stats.prefix_cache_hit_rate > 0

    text = (await AsyncClient().get("/metrics", headers=operator_headers)).content.decode()

    # prometheus_client writes label pairs sorted by name.
    labels = f'model="{world.model}",tenant="{world.tenant_a.slug}"'
    assert (
        f'pagoda_requests_total{{model="{world.model}",status="success",tenant="{world.tenant_a.slug}"}} 2.0'
        in text
    )
    assert f"pagoda_completion_tokens_total{{{labels}}} 4.0" in text
    assert f"pagoda_cached_tokens_total{{{labels}}} {float(cached)}" in text
    assert f"pagoda_time_to_first_token_seconds_count{{{labels}}} 2.0" in text
    # Each request's time to first token taken apart by the replica (engine.protocol.Event.timing).
    assert f"pagoda_request_queue_seconds_count{{{labels}}} 2.0" in text
    assert f"pagoda_engine_first_token_seconds_count{{{labels}}} 2.0" in text
    assert f"pagoda_e2e_request_latency_seconds_count{{{labels}}} 2.0" in text
    # An unknown model name is not a label value: it cannot mint new series.
    assert (
        f'pagoda_request_errors_total{{code="model_not_found",model="-",tenant="{world.tenant_a.slug}"}}'
        in text
    )
    model = f'{{model="{world.model}"}}'
    assert f"pagoda_engine_replicas{model} 1.0" in text
    assert f"pagoda_engine_running_requests{model} 0.0" in text
    assert f"pagoda_engine_prefix_cache_hit_rate{model} {stats.prefix_cache_hit_rate!r}" in text
    assert f"pagoda_engine_total_kv_blocks{model} {float(NUM_BLOCKS)}" in text
    assert f"pagoda_engine_free_kv_blocks{model} {float(stats.num_free_blocks)}" in text
    assert f"pagoda_engine_spec_draft_tokens{model} {float(stats.spec_num_draft_tokens)}" in text
    assert f"pagoda_engine_spec_accepted_tokens{model} {float(stats.spec_num_accepted_tokens)}" in text
    # Per replica: both requests were routed to this replica's own stream (it is the only one).
    replica = f'{{model="{world.model}",replica="{engine_worker.settings.replica_id}"}}'
    assert stats.num_routed_requests == 2
    assert f"pagoda_engine_replica_routed_requests{replica} 2.0" in text
    assert f"pagoda_engine_replica_stolen_requests{replica} 0.0" in text
    assert f"pagoda_engine_replica_interrupted_steps{replica} 0.0" in text  # no flex request ran
    assert f"pagoda_engine_replica_prefix_cache_hit_rate{replica} {stats.prefix_cache_hit_rate!r}" in text
    assert "request_id" not in text


def test_admin_shows_live_replicas(world, engine_worker):
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(admin)
    page = client.get(f"/admin/inference/modeldeployment/{world.deployment.pk}/change/")
    assert page.status_code == 200
    # An idle replica that has served nothing yet.
    row = (
        f"<tr><td>{engine_worker.settings.replica_id}</td><td>0</td><td>0</td><td>0.0%</td><td>0.0%</td>"
        f"<td>{NUM_BLOCKS} / {NUM_BLOCKS}</td><td>0 / 0</td></tr>"
    )
    assert row in page.content.decode()
    listing = client.get("/admin/inference/modeldeployment/")
    assert listing.status_code == 200


async def test_the_live_set_is_one_read_for_every_request_checking_at_once(world):
    await world.faults.heartbeat()
    before = _zrange_calls()
    # 32 streams whose waits ran out at the same moment (a long engine step) check their replicas.
    sets = await asyncio.gather(*(live_replica_set_async(world.model) for _ in range(32)))
    assert set(sets) == {frozenset({world.faults.replica_id})}
    assert _zrange_calls() - before == 1

    # A replica that appears is seen once the snapshot is older than LIVE_SET_MAX_AGE_S.
    await ProtocolFaultInjector(world.model, replica_id="fault-injector-2").heartbeat()

    async def sees_it() -> bool:
        return "fault-injector-2" in await live_replica_set_async(world.model)

    await async_wait_until(sees_it, timeout=10, interval=LIVE_SET_MAX_AGE_S / 5, what="the new replica")


def _zrange_calls() -> int:
    return int(get_redis().info("commandstats").get("cmdstat_zrangebyscore", {}).get("calls", 0))
