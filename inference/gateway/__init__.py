"""The web tier's side of the Redis contract (engine/protocol.py): queue requests, read their events,
signal aborts, and read replica heartbeats."""

from __future__ import annotations

from inference.gateway.client import EngineGateway, get_gateway
from inference.gateway.replicas import (
    live_replica_ids,
    live_replica_ids_async,
    live_replica_set_async,
    ready_replica_ids,
    ready_replica_ids_async,
    replica_stats_list,
)

__all__ = [
    "EngineGateway",
    "get_gateway",
    "live_replica_ids",
    "live_replica_ids_async",
    "live_replica_set_async",
    "ready_replica_ids",
    "ready_replica_ids_async",
    "replica_stats_list",
]
