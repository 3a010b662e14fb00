"""The heartbeat of a replica whose step outlasts the heartbeat TTL (a big prefill on a busy CPU):
it stays fresh, so the web tier does not take a slow replica for a dead one; a loop stalled past
the stall limit stops beating and expires as a dead replica would. Real Redis, a real tiny engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.protocol import replica_stats_key, replicas_key
from tests.engine.test_worker import MODEL, REDIS_URL, drop_keys, events_of, new_prefix, submit, wait_for

pytestmark = pytest.mark.slow

TTL_S = 0.6
SLOW_STEP_S = 2.0


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(REDIS_URL)
    yield c
    c.close()


@pytest.fixture
def slow_worker(client: redis.Redis, tiny_llama_dir: Path) -> Iterator[tuple]:
    """A worker in a thread whose engine's second step takes SLOW_STEP_S; yields (worker, prefix, in_step)."""
    from engine.llm_engine import LLMEngine
    from engine.worker import EngineWorker, RequestQueue, WorkerSettings

    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(tiny_llama_dir),
            device="cpu",
            dtype="float32",
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=4),
        )
    )
    real_step, calls, in_step = engine.step, [], threading.Event()

    def slow_step():
        calls.append(1)
        if len(calls) == 2:
            in_step.set()
            time.sleep(SLOW_STEP_S)
            in_step.clear()
        return real_step()

    engine.step = slow_step
    prefix = new_prefix()
    settings = WorkerSettings(
        model=MODEL,
        prefix=prefix,
        replica_id="slow",
        heartbeat_interval_s=0.1,
        heartbeat_ttl_s=TTL_S,
        idle_block_ms=50,
    )
    queue = RequestQueue(
        client, prefix=prefix, model=MODEL, replica_id="slow", output_ttl_s=60, heartbeat_ttl_s=TTL_S
    )
    worker = EngineWorker(engine, queue, settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker, prefix, in_step
    finally:
        worker.request_stop()
        worker.request_stop()
        thread.join(timeout=30)
        drop_keys(client, prefix)


def heartbeat_during_slow_step(
    client: redis.Redis, prefix: str, in_step: threading.Event
) -> list[tuple[float, bool]]:
    """(age of the replica's beat, whether its stats key is there), sampled while the slow step runs."""
    wait_for(in_step.is_set, 30, "the slow step")
    samples = []
    # Sampling, not waiting: the samples are what the test checks, for as long as the step lasts.
    while in_step.is_set():
        score = client.zscore(replicas_key(prefix, MODEL), "slow")
        has_stats = client.exists(replica_stats_key(prefix, MODEL, "slow")) == 1
        samples.append((float("inf") if score is None else time.time() - score, has_stats))
        time.sleep(0.05)
    return samples


def test_a_step_longer_than_the_ttl_keeps_the_heartbeat_fresh(client, slow_worker):
    worker, prefix, in_step = slow_worker
    submit(client, prefix, "long", max_tokens=4, ignore_eos=True)

    samples = heartbeat_during_slow_step(client, prefix, in_step)

    assert len(samples) >= 10
    assert max(age for age, _ in samples) < TTL_S
    assert all(has_stats for _, has_stats in samples)
    wait_for(
        lambda: [e.type for e in events_of(client, prefix, "long")][-1:] == ["finished"], 30, "the request"
    )


def test_a_loop_stalled_past_the_stall_limit_stops_beating(client, slow_worker, monkeypatch):
    import engine.worker.heartbeat as heartbeat

    monkeypatch.setattr(heartbeat, "STALL_LIMIT_S", 0.3)
    worker, prefix, in_step = slow_worker
    submit(client, prefix, "stalled", max_tokens=4, ignore_eos=True)

    samples = heartbeat_during_slow_step(client, prefix, in_step)

    assert max(age for age, _ in samples) > TTL_S
    assert samples[-1][1] is False  # the stats key expired with its TTL
