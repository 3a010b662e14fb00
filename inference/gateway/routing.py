"""Prefix-aware routing: which of a model's replicas a request is queued to.

A request's routing key is its tenant's cache salt (and adapter) with the hashes of its prompt's
full prefix-cache blocks, each hash chaining the ones before it: the blocks the engine's prefix
cache would find. A client's `prompt_cache_key` replaces the prompt's hashes (OpenAI: requests that
share a key share a cache).

- Where a prefix of the prompt was routed before (the prefix index: `{prefix}prefix:{model}:{hash}`
  -> replica, with a TTL; written for the powers of two of a prompt's blocks and for its last full
  block, so a conversation's next turn finds the one before), and that prefix is at least
  ROUTING_MIN_MATCH of the prompt, the request goes where the longest such prefix went.
- Otherwise (a conversation's first turn, a new document) to the less loaded of the first two
  replicas in rendezvous order of its key (highest random weight; the first on a tie): a new
  conversation starts where there is room, and its next turns follow it there. A request with a
  `prompt_cache_key` goes to the first replica in that order, so that replicas joining or leaving
  move only their share of keys.
- Either way only to a ready replica whose load is under the bound: (1 + ROUTING_LOAD_EPSILON) x
  the mean, or the mean plus ROUTING_LOAD_SLACK requests, whichever is more (consistent hashing
  with bounded loads; the slack keeps a conversation where its cache is while loads are a handful
  of requests, where one more costs a batching engine little); the next replica in rendezvous order
  otherwise. A replica's load is its running and waiting requests from its heartbeat (up to a
  heartbeat old), or what this process has in flight on it, whichever is more.

Nothing routes centrally: the request is queued to the chosen replica's own stream, which that
replica reads before the model's shared stream, and from which an idle replica steals what waited
past its steal delay (engine.worker.queue). A replica whose stream is gone (it left) is skipped at
the queueing itself: the request goes to the shared stream. The keys are salted per tenant: two
tenants with the same prompt never share an index entry, as they never share cached blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import weakref
from array import array
from dataclasses import dataclass, field

from django.conf import settings

from core.redis_client import get_async_redis
from engine.protocol import ProtocolError, ReplicaStats, prefix_route_key
from inference.gateway.replicas import LoopShared, heartbeats_async, without_draining

# A replica holding more than (1 + epsilon) x the mean load, and more than the mean plus the slack,
# takes no more requests by preference.
ROUTING_LOAD_EPSILON = 0.25
ROUTING_LOAD_SLACK = 2
# A prompt follows the replica its longest known prefix went to only when that prefix is at least
# this share of its blocks (a conversation's next turn, a document asked about again); a prompt
# that only shares a short head with others (a system prompt) is placed by its own key.
ROUTING_MIN_MATCH = 0.5
# Blocks of a prompt hashed for routing (at 16 tokens a block, the first 8,192 tokens).
MAX_ROUTED_BLOCKS = 512
# How long an index entry names the replica a prefix went to (a prefix cache keeps blocks while
# they are used; an entry older than this most likely points at evicted blocks).
PREFIX_INDEX_TTL_S = 900
# How long one event loop reuses the replicas' loads read from their heartbeats.
LOADS_MAX_AGE_S = 0.25


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the web tier knows of a request for routing it (from its plan)."""

    enabled: bool
    block_size: int
    prompt_cache_key: str = ""


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: a replica, and the index entries to write with its queueing."""

    replica: str
    index_keys: tuple[str, ...] = ()


@dataclass(slots=True)
class RouteKey:
    key: str  # rendezvous key: the last block hash, or the prompt_cache_key's
    block_hashes: list[str] = field(default_factory=list)  # chained, one per full block


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return h.digest()


def routing_key(
    *, salt: str, prompt_token_ids: list[int], block_size: int, prompt_cache_key: str = ""
) -> RouteKey:
    """The key a prompt is routed by (see the module's docstring)."""
    seed = _digest(b"pagoda-route\0", salt.encode())
    if prompt_cache_key:
        return RouteKey(key=_digest(seed, b"\0key\0", prompt_cache_key.encode()).hex())
    hashes: list[str] = []
    previous = seed
    full = min(len(prompt_token_ids) // block_size, MAX_ROUTED_BLOCKS)
    for i in range(full):
        block = prompt_token_ids[i * block_size : (i + 1) * block_size]
        previous = _digest(previous, array("q", block).tobytes())
        hashes.append(previous.hex())
    if hashes:
        return RouteKey(key=hashes[-1], block_hashes=hashes)
    # Shorter than a block: nothing is cached for it; its tokens still spread the keys.
    return RouteKey(key=_digest(seed, array("q", prompt_token_ids).tobytes()).hex())


def rendezvous_order(key: str, replicas: list[str]) -> list[str]:
    """Replicas by their weight for `key`, highest first (highest random weight hashing)."""
    return sorted(replicas, key=lambda r: _digest(key.encode(), b"\0", r.encode()), reverse=True)


def load_bound(
    loads: dict[str, float], epsilon: float = ROUTING_LOAD_EPSILON, slack: int = ROUTING_LOAD_SLACK
) -> float:
    """A replica takes a request by preference only while its load is below this: consistent
    hashing with bounded loads (ceil((1 + epsilon) x (total + 1) / replicas)), or the mean plus
    `slack`, whichever is more."""
    total, n = sum(loads.values()), len(loads)
    return max(math.ceil((1 + epsilon) * (total + 1) / n), math.ceil(total / n) + slack)


def choose_replica(key: str, loads: dict[str, float], *, preferred: str | None = None) -> str:
    """`preferred` when it is under the load bound, else the first replica in rendezvous order of
    `key` that is; when none is (cannot happen with epsilon > 0), the least loaded."""
    bound = load_bound(loads)
    if preferred is not None and loads.get(preferred, math.inf) < bound:
        return preferred
    for replica in rendezvous_order(key, list(loads)):
        if loads[replica] < bound:
            return replica
    return min(loads, key=lambda r: loads[r])


def index_positions(num_blocks: int) -> list[int]:
    """Block counts (1-based) whose prefix hash is written to the index: the powers of two and the last."""
    positions = set()
    p = 1
    while p <= num_blocks:
        positions.add(p)
        p *= 2
    if num_blocks:
        positions.add(num_blocks)
    return sorted(positions)


# The replicas' loads from their heartbeats, as each event loop read them last.
_loads: LoopShared[dict[str, float]] = LoopShared(LOADS_MAX_AGE_S)


async def _read_loads(model: str) -> dict[str, float]:
    return _loads_of(*await heartbeats_async(model))


async def ready_replica_ids_for_admission(model: str) -> list[str]:
    """Admission's read of `model`'s ready replicas (ready_replica_ids_async: always read afresh);
    the loads it read serve this event loop's routing as a read of its own would (LOADS_MAX_AGE_S),
    so the request it admits is routed without reading the heartbeats a second time."""
    ids, raw = await heartbeats_async(model)
    _loads.put(model, _loads_of(ids, raw))
    return without_draining(ids, raw)


def _loads_of(ids: list[str], raw: list) -> dict[str, float]:
    """The loads of the replicas whose stats (`raw`, in the order of `ids`) decode and are not
    draining: their running and waiting requests."""
    loads: dict[str, float] = {}
    for replica, data in zip(ids, raw, strict=True):
        if data is None:
            continue  # its stats expired a moment before its score: not routed to
        try:
            stats = ReplicaStats.decode(data)
        except ProtocolError:
            continue
        if not stats.draining:
            loads[replica] = float(stats.num_running + stats.num_waiting)
    return loads


# Each event loop's requests in flight, by (model, replica), as it routed them (`routed`, `ended`).
_in_flight: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], int]] = (
    weakref.WeakKeyDictionary()
)


def routed(model: str, replica: str) -> None:
    """A request of this event loop was queued to `replica`: in flight until `ended`."""
    counts = _in_flight.setdefault(asyncio.get_running_loop(), {})
    counts[(model, replica)] = counts.get((model, replica), 0) + 1


def ended(model: str, replica: str) -> None:
    counts = _in_flight.setdefault(asyncio.get_running_loop(), {})
    left = counts.get((model, replica), 0) - 1
    if left > 0:
        counts[(model, replica)] = left
    else:
        counts.pop((model, replica), None)


async def replica_loads(model: str) -> dict[str, float]:
    """The ready replicas of `model` and their loads: from their heartbeats, read once per
    LOADS_MAX_AGE_S by this event loop, or what it has in flight on them, whichever is more."""
    heartbeats = await _heartbeat_loads(model)
    counts = _in_flight.get(asyncio.get_running_loop(), {})
    return {r: max(load, float(counts.get((model, r), 0))) for r, load in heartbeats.items()}


async def _heartbeat_loads(model: str) -> dict[str, float]:
    return await _loads.get(model, lambda: _read_loads(model))


async def route(*, model: str, salt: str, prompt_token_ids: list[int], hint: RouteHint) -> Route | None:
    """The replica to queue a request to, or None for the model's shared stream (routing off, or
    no ready replica)."""
    if not hint.enabled:
        return None
    loads = await replica_loads(model)
    if not loads:
        return None
    key = routing_key(
        salt=salt,
        prompt_token_ids=prompt_token_ids,
        block_size=hint.block_size,
        prompt_cache_key=hint.prompt_cache_key,
    )
    prefix = settings.REDIS_PREFIX
    preferred = None
    if len(loads) > 1 and key.block_hashes:
        known = await get_async_redis().mget([prefix_route_key(prefix, model, h) for h in key.block_hashes])
        for matched in range(len(known), 0, -1):  # the longest prefix routed before
            value = known[matched - 1]
            replica = value.decode() if isinstance(value, bytes) else value
            if replica in loads:
                # A short shared head (a system prompt) does not pull every prompt after it.
                if matched >= ROUTING_MIN_MATCH * len(known):
                    preferred = replica
                break
    if preferred is None and not hint.prompt_cache_key:
        # Nothing of it is cached anywhere (beyond a short shared head): two choices.
        first_two = rendezvous_order(key.key, list(loads))[:2]
        preferred = min(first_two, key=lambda r: (loads[r], first_two.index(r)))
    replica = choose_replica(key.key, loads, preferred=preferred)
    # One replica: nothing to choose between, and nothing to remember (the index fills again
    # within a conversation's turn once there are more).
    index_keys = (
        tuple(
            prefix_route_key(prefix, model, key.block_hashes[p - 1])
            for p in index_positions(len(key.block_hashes))
        )
        if len(loads) > 1
        else ()
    )
    return Route(replica=replica, index_keys=index_keys)
