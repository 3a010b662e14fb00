"""Settings of one engine replica's Redis loop, checked on construction."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from engine.config import ConfigError
from engine.worker.outputs import QUIET_PUBLISH_S


def default_replica_id() -> str:
    # Unique per process: a restarted process under a new id leaves the old one's requests to be
    # reclaimed by timeout; a supervisor that wants a restart to resume at once passes a fixed id.
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class WorkerSettings:
    model: str  # served name: selects the request stream and names the replica in heartbeats
    prefix: str = "pagoda:"
    replica_id: str = ""
    # A request pending this long in a replica that stopped touching it is taken by another replica.
    claim_timeout_ms: int = 15_000
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    output_ttl_s: int = 600
    # How long an idle replica waits on the request stream per read; bounds the latency of
    # noticing a signal, a cancel or a reclaim while idle.
    idle_block_ms: int = 200
    # A request delivered more often than this failed on every replica that took it (it may be what
    # kills them): it is answered with an error instead of being run again.
    max_deliveries: int = 3
    # A request whose replica is lost while it streams is continued by another replica (a failover)
    # at most this many times; after that it ends with engine_failed. 0: never continued.
    max_failovers: int = 2
    # Requests held at once (running + waiting in the engine); the rest stay in the shared stream
    # where another replica can take them. 0: 256 (`engine serve` passes twice its max_num_seqs).
    max_held: int = 0
    # An idle replica (nothing running or waiting) takes requests routed to another replica's stream
    # that nobody read for this long (that replica is busy, stalled or gone). 0: never.
    steal_after_ms: int = 500
    # How far back the cancel stream is read at start, to see cancels of requests taken later.
    cancel_lookback_s: float = 60.0
    # A draining replica (first SIGTERM) gives this long to the sequences it runs; then every request
    # it holds is handed back (one that streamed is continued by the replica taking it).
    drain_grace_s: float = 30.0
    # A spare-capacity (flex) step is given up between layers when a more important request
    # arrives (engine.step_interrupt, engine.worker.arrivals).
    step_interrupts: bool = True
    # A request whose reader answers once (GenerateRequest.stream false) has its output after its
    # first tokens published at most this often, and at its end. 0: every step, as a streamed one.
    quiet_publish_s: float = QUIET_PUBLISH_S

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model (the served name) is required")
        if not self.replica_id:
            self.replica_id = default_replica_id()
        if self.claim_timeout_ms < 100:
            raise ConfigError(f"claim_timeout_ms must be >= 100, got {self.claim_timeout_ms}")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ConfigError("need 0 < heartbeat_interval_s < heartbeat_ttl_s")
        if self.output_ttl_s < 1:
            raise ConfigError("output_ttl_s must be >= 1")
        if self.idle_block_ms < 1 or self.max_deliveries < 1 or self.max_held < 0:
            raise ConfigError("idle_block_ms and max_deliveries must be >= 1, max_held >= 0")
        if self.max_failovers < 0:
            raise ConfigError(f"max_failovers must be >= 0, got {self.max_failovers}")
        if self.steal_after_ms < 0:
            raise ConfigError(f"steal_after_ms must be >= 0, got {self.steal_after_ms}")
        if self.quiet_publish_s < 0:
            raise ConfigError(f"quiet_publish_s must be >= 0, got {self.quiet_publish_s}")
        if self.drain_grace_s < 0:
            raise ConfigError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")

    @property
    def touch_interval_s(self) -> float:
        # Three touches per timeout: a replica must miss several in a row to lose its requests.
        return self.claim_timeout_ms / 3000

    @property
    def steal_interval_s(self) -> float:
        # Looked for a few times per delay, at most every 50 ms (a round trip per other replica).
        return max(0.05, self.steal_after_ms / 4000)

    @property
    def reclaim_interval_s(self) -> float:
        return max(0.1, self.claim_timeout_ms / 2000)
