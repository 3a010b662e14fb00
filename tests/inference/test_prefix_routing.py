"""Prefix-aware routing (inference.gateway.routing): the routing key, rendezvous hashing with bounded
loads, and the gateway queueing to the chosen replica's stream against a real Redis (replicas
announced by heartbeats, without engines)."""

from __future__ import annotations

import time
import uuid

import pytest
from django.conf import settings

from core.redis_client import get_async_redis
from engine.protocol import (
    CONSUMER_GROUP,
    GenerateRequest,
    ReplicaStats,
    replica_requests_stream,
    replica_stats_key,
    replicas_key,
    requests_stream,
)
from inference.gateway import routing
from inference.gateway.client import EngineGateway
from inference.gateway.routing import (
    RouteHint,
    choose_replica,
    index_positions,
    load_bound,
    ready_replica_ids_for_admission,
    rendezvous_order,
    routing_key,
)

BLOCK = 16


def test_a_prompts_key_chains_its_blocks_so_a_longer_prompt_shares_the_shorter_ones_hashes():
    history = list(range(100, 180))  # 5 full blocks
    turn = routing_key(salt="tenant:1", prompt_token_ids=history, block_size=BLOCK)
    next_turn = routing_key(salt="tenant:1", prompt_token_ids=history + [7] * 40, block_size=BLOCK)

    assert len(turn.block_hashes) == 5 and len(next_turn.block_hashes) == 7
    assert next_turn.block_hashes[:5] == turn.block_hashes
    assert turn.key == turn.block_hashes[-1]
    # A partial block adds nothing: the engine caches full blocks only.
    assert routing_key(salt="tenant:1", prompt_token_ids=history + [1, 2], block_size=BLOCK) == turn


def test_tenants_never_share_a_key_and_a_prompt_cache_key_replaces_the_prompts():
    prompt = list(range(64))
    a = routing_key(salt="tenant:1", prompt_token_ids=prompt, block_size=BLOCK)
    b = routing_key(salt="tenant:2", prompt_token_ids=prompt, block_size=BLOCK)
    assert not set(a.block_hashes) & set(b.block_hashes)

    keyed = routing_key(
        salt="tenant:1", prompt_token_ids=prompt, block_size=BLOCK, prompt_cache_key="thread-9"
    )
    other_prompt = routing_key(
        salt="tenant:1", prompt_token_ids=[3] * 200, block_size=BLOCK, prompt_cache_key="thread-9"
    )
    assert keyed.key == other_prompt.key and keyed.block_hashes == []
    other_tenant = routing_key(
        salt="tenant:2", prompt_token_ids=prompt, block_size=BLOCK, prompt_cache_key="thread-9"
    )
    assert other_tenant.key != keyed.key
    # Shorter than a block: keyed by its tokens all the same.
    short = [routing_key(salt="tenant:1", prompt_token_ids=[i], block_size=BLOCK).key for i in range(50)]
    assert len(set(short)) == 50


def test_replicas_joining_or_leaving_move_only_their_share_of_keys():
    keys = [uuid.uuid4().hex for _ in range(2000)]
    three = ["r1", "r2", "r3"]
    before = {k: rendezvous_order(k, three)[0] for k in keys}
    joined = {k: rendezvous_order(k, [*three, "r4"])[0] for k in keys}
    left = {k: rendezvous_order(k, ["r1", "r3"])[0] for k in keys}

    moved = [k for k in keys if joined[k] != before[k]]
    assert all(joined[k] == "r4" for k in moved)  # only to the new replica
    assert 0.15 < len(moved) / len(keys) < 0.35  # about a quarter
    assert all(left[k] == before[k] for k in keys if before[k] != "r2")  # only r2's keys moved
    shares = {r: sum(1 for k in keys if before[k] == r) / len(keys) for r in three}
    assert all(0.25 < share < 0.42 for share in shares.values()), shares


def test_a_replica_over_the_bound_takes_nothing_by_preference():
    # Bound: max(ceil(1.25 x (total + 1) / n), ceil(total / n) + 2).
    assert load_bound({"a": 0, "b": 0}) == 2
    assert load_bound({"a": 10, "b": 10}) == 14
    key = next(k for k in (uuid.uuid4().hex for _ in range(100)) if rendezvous_order(k, ["a", "b"])[0] == "a")
    assert choose_replica(key, {"a": 1, "b": 0}) == "a"
    assert choose_replica(key, {"a": 13, "b": 7}) == "a"  # 13 < 14 = max(ceil(1.25 x 21 / 2), 10 + 2)
    assert choose_replica(key, {"a": 14, "b": 6}) == "b"
    assert choose_replica(key, {"a": 0, "b": 12}, preferred="b") == "a"  # over the bound: preference lost
    assert choose_replica(key, {"a": 0, "b": 1}, preferred="b") == "b"


def test_the_index_is_written_at_powers_of_two_and_the_last_block():
    assert index_positions(0) == []
    assert index_positions(1) == [1]
    assert index_positions(11) == [1, 2, 4, 8, 11]
    assert index_positions(16) == [1, 2, 4, 8, 16]


# --- the gateway against Redis --------------------------------------------------------------------------------


@pytest.fixture
async def model():
    name = f"routed-{uuid.uuid4().hex[:8]}"
    yield name
    redis = get_async_redis()
    async for key in redis.scan_iter(match=f"{settings.REDIS_PREFIX}*{name}*", count=1000):
        await redis.delete(key)


async def announce(
    model: str, replica: str, *, running: int = 0, draining: bool = False, stream: bool = True
):
    """A replica as the web tier sees one: a heartbeat, and its own stream (with its group)."""
    redis = get_async_redis()
    stats = ReplicaStats(
        replica_id=replica,
        model=model,
        num_running=running,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_hit_rate=0.0,
        draining=draining,
    )
    await redis.set(replica_stats_key(settings.REDIS_PREFIX, model, replica), stats.encode(), ex=30)
    await redis.zadd(replicas_key(settings.REDIS_PREFIX, model), {replica: time.time()})
    if stream:
        await redis.xgroup_create(
            replica_requests_stream(settings.REDIS_PREFIX, model, replica),
            CONSUMER_GROUP,
            id="0",
            mkstream=True,
        )
    routing._loads.clear()  # the next route reads the heartbeats again


async def queued_where(model: str, request_id: str) -> str:
    """Which stream the request was queued to: a replica's id, or 'shared'."""
    redis = get_async_redis()
    streams = {"shared": requests_stream(settings.REDIS_PREFIX, model)}
    for replica in ("left", "right"):
        streams[replica] = replica_requests_stream(settings.REDIS_PREFIX, model, replica)
    for name, stream in streams.items():
        for _, fields in await redis.xrange(stream):
            if GenerateRequest.decode(fields).request_id == request_id:
                return name
    raise AssertionError(f"{request_id} was not queued")


async def submit(
    model: str, request_id: str, prompt: list[int], *, salt: str = "tenant:1", enabled: bool = True
):
    gateway = EngineGateway(prefix=settings.REDIS_PREFIX)
    request = GenerateRequest(
        request_id=request_id, model=model, prompt_token_ids=prompt, sampling_params={}, cache_salt=salt
    )
    await gateway.submit(request, route=RouteHint(enabled=enabled, block_size=BLOCK))
    return gateway


def prompt_preferring(
    replica: str, replicas: list[str], *, salt: str = "tenant:1", nth: int = 0
) -> list[int]:
    """The `nth` prompt of three blocks (each of its own tokens) whose own key ranks `replica` first."""
    found = 0
    for seed in range(1000):
        prompt = [seed * 100 + i for i in range(48)]
        key = routing_key(salt=f"{salt}\0", prompt_token_ids=prompt, block_size=BLOCK).key
        if rendezvous_order(key, replicas)[0] == replica:
            if found == nth:
                return prompt
            found += 1
    raise AssertionError("no prompt found")


async def test_the_next_turn_goes_where_its_history_went_even_where_its_own_key_points_elsewhere(model):
    await announce(model, "left")
    await announce(model, "right")
    first = prompt_preferring("left", ["left", "right"])
    gateways = [await submit(model, "turn-1", first)]
    assert await queued_where(model, "turn-1") == "left"

    # Extended until its own key ranks the other replica first: the index still sends it left.
    for extra in range(1, 500):
        longer = first + [9000 + i for i in range(extra * BLOCK)]
        key = routing_key(salt="tenant:1\0", prompt_token_ids=longer, block_size=BLOCK).key
        if rendezvous_order(key, ["left", "right"])[0] == "right":
            break
    gateways.append(await submit(model, "turn-2", longer))
    assert await queued_where(model, "turn-2") == "left"

    # Another tenant's identical prompt knows nothing of the first tenant's index (and, with the
    # loads equal again, goes where its own key ranks first).
    for gateway, request_id in zip(gateways, ("turn-1", "turn-2"), strict=True):
        await gateway.forget([request_id])
    await submit(model, "other-tenant", longer, salt="tenant:2")
    other_key = routing_key(salt="tenant:2\0", prompt_token_ids=longer, block_size=BLOCK).key
    assert await queued_where(model, "other-tenant") == rendezvous_order(other_key, ["left", "right"])[0]


async def test_load_draining_gone_streams_and_the_off_switch_decide_the_stream(model):
    prompt = prompt_preferring("left", ["left", "right"])
    # Routing off: the shared stream, whatever the replicas.
    await announce(model, "left")
    await announce(model, "right")
    await submit(model, "off", prompt_preferring("left", ["left", "right"], nth=1), enabled=False)
    assert await queued_where(model, "off") == "shared"

    # The preferred replica over the bound: the next in rendezvous order.
    await announce(model, "left", running=9, stream=False)
    await submit(model, "busy", prompt)
    assert await queued_where(model, "busy") == "right"

    # Draining: not routed to.
    await announce(model, "left", draining=True, stream=False)
    await submit(model, "draining", prompt)
    assert await queued_where(model, "draining") == "right"

    # Its stream gone (it left): the shared stream, in the same script as the queueing.
    await announce(model, "left", stream=False)
    await get_async_redis().delete(replica_requests_stream(settings.REDIS_PREFIX, model, "left"))
    await submit(model, "gone", prompt_preferring("left", ["left", "right"], nth=2))
    assert await queued_where(model, "gone") == "shared"


async def test_requests_in_flight_count_as_load_until_forgotten(model):
    await announce(model, "left")
    await announce(model, "right")
    prompt = prompt_preferring("left", ["left", "right"])
    gateways = []
    for i in range(3):  # the bound for 3 in flight on 2 replicas: max(ceil(1.25 x 4 / 2), 2 + 2) = 4
        gateways.append(await submit(model, f"held-{i}", prompt))
        assert await queued_where(model, f"held-{i}") == "left"
    gateways.append(await submit(model, "held-3", prompt))
    assert await queued_where(model, "held-3") == "left"
    # Four in flight on the left (heartbeats say none): 4 >= max(ceil(1.25 x 5 / 2), 2 + 2) = 4.
    await submit(model, "spilled", prompt)
    assert await queued_where(model, "spilled") == "right"

    # The four end: a new prompt that prefers the left goes there again (with them still counted,
    # it would have spilled too).
    for i, gateway in enumerate(gateways):
        await gateway.forget([f"held-{i}"])
    await submit(model, "after", prompt_preferring("left", ["left", "right"], nth=1))
    assert await queued_where(model, "after") == "left"


async def test_a_first_turn_takes_the_less_loaded_of_its_two_choices_unless_it_names_a_cache_key(model):
    await announce(model, "left")
    await announce(model, "right")
    busy = await submit(model, "running", prompt_preferring("left", ["left", "right"], nth=3))
    assert await queued_where(model, "running") == "left"

    # Prefers the left by its key, but the left has one in flight and the right none.
    await submit(model, "first-turn", prompt_preferring("left", ["left", "right"], nth=4))
    assert await queued_where(model, "first-turn") == "right"

    # A prompt_cache_key keeps its key's first choice while it is under the bound.
    gateway = EngineGateway(prefix=settings.REDIS_PREFIX)
    for seed in range(1000):
        key = f"thread-{seed}"
        salted = routing_key(salt="tenant:1\0", prompt_token_ids=[], block_size=BLOCK, prompt_cache_key=key)
        if rendezvous_order(salted.key, ["left", "right"])[0] == "left":
            break
    request = GenerateRequest(
        request_id="keyed", model=model, prompt_token_ids=[5] * 40, sampling_params={}, cache_salt="tenant:1"
    )
    await gateway.submit(request, route=RouteHint(enabled=True, block_size=BLOCK, prompt_cache_key=key))
    assert await queued_where(model, "keyed") == "left"
    await busy.forget(["running"])


async def test_admission_reads_the_heartbeats_afresh_and_its_read_routes_the_request(model, monkeypatch):
    await announce(model, "left")
    await announce(model, "right")
    assert sorted(await ready_replica_ids_for_admission(model)) == ["left", "right"]
    await announce(model, "left", draining=True, stream=False)
    assert await ready_replica_ids_for_admission(model) == ["right"]

    # The request it admitted is routed by that read: the heartbeats are not read a second time.
    def read_again(model: str):
        raise AssertionError("routing read the heartbeats again")

    monkeypatch.setattr(routing, "_read_loads", read_again)
    await submit(model, "admitted", prompt_preferring("left", ["left", "right"]))
    assert await queued_where(model, "admitted") == "right"
