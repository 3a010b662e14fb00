"""The queue depth an autoscaler reads, against a real Redis 7 and a real engine replica.

KEDA's redis-streams trigger reads the consumer group's lag (`lagCount`, XINFO GROUPS, Redis 7)
and its pending count (`pendingEntriesCount`, XPENDING) on the model's shared stream, or the
stream's length before any replica made the group. /metrics exports the same two figures over
every request stream of the model (pagoda_queue_depth, pagoda_queue_pending). Both must match
what is queued and what is held.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from django.conf import settings
from django.test import Client

from engine.protocol import (
    CONSUMER_GROUP,
    GenerateRequest,
    replica_requests_stream,
    requests_stream,
    routes_key,
)
from inference.gateway.queue_depth import QueueDepth, queue_depth
from tests.helpers import wait_until
from tests.inference.conftest import tiny_engine

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(settings.REDIS_URL)
    if int(c.info("server")["redis_version"].split(".")[0]) < 7:
        c.close()
        pytest.skip("KEDA's lag needs Redis 7 (XINFO GROUPS lag); this Redis is older")
    yield c
    c.close()


@pytest.fixture(autouse=True)
def empty_streams(world, client) -> Iterator[None]:
    """The world's model is every test's: start and end with none of its request streams."""

    def drop() -> None:
        prefix = settings.REDIS_PREFIX
        for key in client.scan_iter(match=f"{requests_stream(prefix, world.model)}*", count=1000):
            client.delete(key)
        client.delete(routes_key(prefix, world.model))

    drop()
    yield
    drop()


def queue(client: redis.Redis, model: str, request_id: str, max_tokens: int = 4) -> None:
    request = GenerateRequest(
        request_id=request_id,
        model=model,
        prompt_token_ids=[5, 17, 301, 42, 7, 99],
        sampling_params={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        tenant="tenant-a",
    )
    client.xadd(requests_stream(settings.REDIS_PREFIX, model), request.encode())


def keda_reads(client: redis.Redis, model: str) -> dict[str, int | None]:
    """What KEDA's redis-streams scaler reads of the shared stream: the group's lag (lagCount), the
    pending count (pendingEntriesCount), and the length (its fallback before the group exists)."""
    stream = requests_stream(settings.REDIS_PREFIX, model)
    found: dict[str, int | None] = {"length": client.xlen(stream)}
    for group in client.xinfo_groups(stream):
        if group["name"].decode() == CONSUMER_GROUP:
            found["lag"] = group["lag"]
            found["pending"] = client.xpending(stream, CONSUMER_GROUP)["pending"]
    return found


def gauges(model: str, headers: dict[str, str]) -> tuple[str, str]:
    text = Client().get("/metrics", headers=headers).content.decode()
    labels = f'{{model="{model}"}}'
    return (
        next(line for line in text.splitlines() if line.startswith(f"pagoda_queue_depth{labels} ")),
        next(line for line in text.splitlines() if line.startswith(f"pagoda_queue_pending{labels} ")),
    )


def test_lag_and_pending_match_what_is_queued_and_held_through_a_drain(world, client, operator_headers):
    from engine.worker import EngineWorker, RequestQueue, WorkerSettings

    model, prefix = world.model, settings.REDIS_PREFIX
    for i in range(5):
        queue(client, model, f"r{i}")

    # No replica yet: no consumer group; KEDA falls back to the stream's length.
    assert keda_reads(client, model) == {"length": 5}
    assert queue_depth(model) == QueueDepth(waiting=5, pending=0)
    assert gauges(model, operator_headers) == (
        f'pagoda_queue_depth{{model="{model}"}} 5.0',
        f'pagoda_queue_pending{{model="{model}"}} 0.0',
    )

    # A replica that holds two (one running, one waiting behind it), its steps held at a gate.
    engine = tiny_engine(world.deployment.model_path, max_num_seqs=1)
    real_step, gate = engine.step, threading.Event()
    engine.step = lambda: (gate.wait(), real_step())[1]
    ws = WorkerSettings(model=model, prefix=prefix, max_held=2, heartbeat_interval_s=0.2, idle_block_ms=20)
    worker = EngineWorker(
        engine,
        RequestQueue(
            client,
            prefix=prefix,
            model=model,
            replica_id=ws.replica_id,
            output_ttl_s=60,
            heartbeat_ttl_s=ws.heartbeat_ttl_s,
        ),
        ws,
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(worker.held) == 2, timeout=30, what="the replica to hold two requests")

        assert keda_reads(client, model) == {"length": 5, "lag": 3, "pending": 2}
        assert queue_depth(model) == QueueDepth(waiting=3, pending=2)
        assert gauges(model, operator_headers) == (
            f'pagoda_queue_depth{{model="{model}"}} 3.0',
            f'pagoda_queue_pending{{model="{model}"}} 2.0',
        )

        # A drain hands the unstarted one back (a new entry; the old one deleted) and finishes the other.
        worker.request_stop()
        gate.set()
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        gate.set()
        worker.request_stop()
        worker.request_stop()
        thread.join(timeout=30)

    # The deletion of a delivered entry leaves Redis able to tell the lag: KEDA still sees it.
    reads = keda_reads(client, model)
    assert (reads["lag"], reads["pending"]) == (4, 0)
    assert queue_depth(model) == QueueDepth(waiting=4, pending=0)


def test_the_gauges_count_requests_routed_to_a_replicas_own_stream(world, client, operator_headers):
    model, prefix = world.model, settings.REDIS_PREFIX
    queue(client, model, "shared-1")
    routed = replica_requests_stream(prefix, model, "replica-b")
    client.xgroup_create(routed, CONSUMER_GROUP, id="0", mkstream=True)
    client.sadd(routes_key(prefix, model), "replica-b")
    for i in range(3):
        client.xadd(routed, {"data": f"routed-{i}"})
    client.xreadgroup(CONSUMER_GROUP, "replica-b", {routed: ">"}, count=1)

    # KEDA on the shared stream sees one; the gauge sees all four, and the one taken.
    assert keda_reads(client, model) == {"length": 1}
    assert queue_depth(model) == QueueDepth(waiting=3, pending=1)
    assert gauges(model, operator_headers) == (
        f'pagoda_queue_depth{{model="{model}"}} 3.0',
        f'pagoda_queue_pending{{model="{model}"}} 1.0',
    )
