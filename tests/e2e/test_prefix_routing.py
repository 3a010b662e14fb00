"""Prefix-aware routing with real processes: two engine replicas of the tiny model behind daphne, the
official `openai` client, prompts as token ids (so each turn's prompt extends the last one exactly).

- 8 conversations of 4 turns (half of them ranking each replica first by their keys): every later
  turn lands on the replica that served the earlier ones, with `cached_tokens` covering the
  history, and both replicas serve conversations.
- A frozen replica (SIGSTOP): a request routed to it is served by the other one, which stole it
  (its heartbeat still looks live: the steal is what moves it).
- Another tenant's identical prompt shares nothing.
- A killed replica: its conversations move to the other replica and go on there.

The tests share one stack and run in file order; the kill is last.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from inference.gateway.routing import rendezvous_order, routing_key
from tests.e2e.settlement import engine_events
from tests.e2e.stack import served_world

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

MODEL = "e2e-tiny-routing"
REPLICAS = ["left", "right"]
BLOCK = 16
# Long enough that a turn waiting behind its replica's others on a loaded machine is not stolen
# (the placement test would see it move), well within a frozen replica's heartbeat TTL.
STEAL_AFTER_MS = 3000
# A frozen replica stays live this long: within it, only a steal can move its requests.
HEARTBEAT_TTL_S = 10
SYSTEM = [11 + i for i in range(BLOCK)]  # one block every conversation starts with
LIMITS = dict(tokens_per_minute=10**8, max_concurrent_requests=100, monthly_token_quota=10**9)


@dataclass
class World:
    stack: Any
    tenant_a: Any
    key_a: str
    tenant_b: Any
    key_b: str


@pytest.fixture(scope="module")
def world(committed_db, e2e_model_dir, tmp_path_factory):
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=REPLICAS,
        model=MODEL,
        model_dir=e2e_model_dir,
        engine_settings={"num_blocks": 512, "max_num_seqs": 4, "steal_after_ms": STEAL_AFTER_MS},
        env={"PAGODA_ENGINE_HEARTBEAT_TTL": str(HEARTBEAT_TTL_S)},
        tenant_a={"name": "Router A", "slug": "e2e-router-a", "allowed_models": [MODEL], **LIMITS},
        tenant_b={"name": "Router B", "slug": "e2e-router-b", "allowed_models": [MODEL], **LIMITS},
        key_names=("router-a", "router-b"),
    ) as (base, stack):
        yield World(stack, base.tenant_a, base.raw_key_a, base.tenant_b, base.raw_key_b)


@dataclass
class Answer:
    request_id: str
    replica: str
    prompt_tokens: int
    cached_tokens: int


def complete(client, prompt: list[int]) -> Answer:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    completion = raw.parse()
    request_id = raw.headers["x-request-id"]
    return Answer(
        request_id,
        engine_events(request_id)[-1].replica,
        completion.usage.prompt_tokens,
        completion.usage.prompt_tokens_details.cached_tokens,
    )


def first_choice(tenant, prompt: list[int]) -> str:
    """The replica a first turn's own key ranks first (the web tier's key: the tenant's cache salt)."""
    key = routing_key(salt=f"tenant:{tenant.id}\0", prompt_token_ids=prompt, block_size=BLOCK).key
    return rendezvous_order(key, REPLICAS)[0]


def first_turns(tenant, *, per_replica: int, start: int) -> list[list[int]]:
    """First turns (the shared block, then 40 tokens of their own) whose keys rank each replica
    first `per_replica` times."""
    chosen: dict[str, list[list[int]]] = {r: [] for r in REPLICAS}
    for seed in range(start, start + 2000):
        prompt = SYSTEM + [100 + (seed * 41 + i) % 1800 for i in range(40)]
        replica = first_choice(tenant, prompt)
        if len(chosen[replica]) < per_replica:
            chosen[replica].append(prompt)
        if all(len(c) == per_replica for c in chosen.values()):
            return [p for pair in zip(*chosen.values(), strict=True) for p in pair]
    raise AssertionError("no such prompts")


def next_turn(prompt: list[int], turn: int) -> list[int]:
    """The history and 24 tokens more (as if the answer and the user's next message)."""
    return prompt + [200 + (turn * 53 + i * 7) % 1500 for i in range(24)]


def full_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


def settled(stack, replicas: list[str] = REPLICAS) -> None:
    """Wait until each replica's heartbeat, beaten from now on, says it runs and holds nothing: the
    web tier places a first turn by the loads in the replicas' last heartbeats, and one beaten
    while an earlier test's request still ran would send it to the other replica."""
    since = time.time()

    def idle() -> bool:
        stats = stack.replica_stats()
        return all(
            r in stats
            and stats[r].heartbeat_at > since
            and stats[r].num_running == 0
            and stats[r].num_waiting == 0
            for r in replicas
        )

    stack.wait_until(idle, timeout=30, what=f"fresh heartbeats of {replicas} with nothing running")


def test_each_conversation_stays_on_one_replica_and_finds_its_history_cached(world):
    client = world.stack.client(world.key_a)
    conversations = first_turns(world.tenant_a, per_replica=4, start=0)

    def converse(first: list[int]) -> list[tuple[list[int], Answer]]:
        turns, prompt = [], first
        for turn in range(4):
            turns.append((prompt, complete(client, prompt)))
            prompt = next_turn(prompt, turn)
        return turns

    # Three at a time: loads stay within the bound, so no turn is sent elsewhere for load.
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(converse, conversations))

    placed = set()
    for turns in results:
        replicas = [answer.replica for _, answer in turns]
        assert replicas == [replicas[0]] * 4, replicas
        placed.add(replicas[0])
        for (previous, _), (_, answer) in zip(turns, turns[1:], strict=False):
            assert answer.cached_tokens >= full_blocks(len(previous)), (answer, len(previous))
    assert placed == set(REPLICAS)
    # All 32 were taken from the replicas' own streams, as their heartbeats say (within a beat).
    world.stack.wait_until(
        lambda: sum(s.num_routed_requests for s in world.stack.replica_stats().values()) >= 32,
        timeout=30,
        what="the replicas' heartbeats to count 32 routed requests",
    )


def test_a_frozen_replicas_requests_are_stolen_by_the_idle_one(world):
    stack = world.stack
    client = stack.client(world.key_a)
    [for_left, for_right] = first_turns(world.tenant_a, per_replica=1, start=5000)
    assert first_choice(world.tenant_a, for_left) == "left"
    # The web process's first request of a kind loads what it needs: done before the freeze, so
    # that the frozen replica's heartbeat outlives the steal delay by far.
    complete(client, for_right)
    settled(stack)
    stolen_before = stack.replica_stats()["right"].num_stolen_requests

    with stack.paused("left"):
        answer = complete(client, for_left)
        # Still live by its heartbeat (so still routed to): served because the right one stole it.
        assert answer.replica == "right"
        assert "left" in stack.replica_stats()

    stack.wait_until(
        lambda: stack.replica_stats()["right"].num_stolen_requests >= stolen_before + 1,
        timeout=30,
        what="the right replica's heartbeat to count the steal",
    )


def test_another_tenants_identical_prompt_finds_nothing_cached(world):
    a, b = world.stack.client(world.key_a), world.stack.client(world.key_b)
    [prompt, _] = first_turns(world.tenant_a, per_replica=1, start=9000)
    prompt = next_turn(next_turn(prompt, 0), 1)
    complete(a, prompt)
    assert complete(a, prompt).cached_tokens >= full_blocks(len(prompt) - 1)
    assert complete(b, prompt).cached_tokens == 0


def test_a_killed_replicas_conversations_go_on_on_the_other(world):
    stack = world.stack
    client = stack.client(world.key_a)
    [for_left, _] = first_turns(world.tenant_a, per_replica=1, start=12000)
    settled(stack)
    assert complete(client, for_left).replica == "left"
    second = next_turn(for_left, 0)

    stack.kill("left")
    # Routed to the dead replica while its heartbeat lives on: taken from its stream all the same.
    answer = complete(client, second)
    assert answer.replica == "right"

    stack.wait_until(
        lambda: set(stack.replica_stats()) == {"right"}, timeout=60, what="the left replica to expire"
    )
    routed_before = stack.replica_stats()["right"].num_routed_requests
    third = next_turn(second, 1)
    answer = complete(client, third)
    # Its key moved: routed to the right replica, where the second turn left the history.
    assert answer.replica == "right"
    assert answer.cached_tokens >= full_blocks(len(second))
    stack.wait_until(
        lambda: stack.replica_stats()["right"].num_routed_requests > routed_before,
        timeout=30,
        what="the right replica's heartbeat to count the routed request",
    )
