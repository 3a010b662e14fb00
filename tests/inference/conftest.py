"""The serving path's variation of the fixture world (tests/conftest.py): a deployment of a tiny
model that A may use, a real engine replica of it on the test Redis prefix, and (world.faults) a
protocol fault injector for what that replica cannot be made to do on demand."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.conf import settings

from core.redis_client import get_async_redis
from engine.protocol import (
    GenerateRequest,
    replica_requests_stream,
    replicas_key,
    requests_stream,
    routes_key,
)
from tests.helpers import async_wait_until, wait_until
from tests.inference.peft_adapters import (  # noqa: F401 - fixtures of the adapter tests
    adapters_dir,
    celery_eager,
    media_root,
)

if TYPE_CHECKING:  # torch loads with the engine: only the tests that run one import it
    from engine.config import LoRAConfig
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput
    from tests.conftest import World

MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
NUM_BLOCKS = 64


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("served-tiny"), arch="llama", size="tiny", seed=0)


@pytest.fixture
def world_options(served_model_dir: Path) -> dict:
    """The serving variation of the fixture world: its model is a fresh deployment of the tiny
    model (A may use it, B may not)."""
    return {"model_dir": served_model_dir, "deployment": {"max_model_len": MAX_MODEL_LEN}}


def tiny_engine(
    model_dir: str,
    *,
    lora: LoRAConfig | None = None,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 8,
    structured_output=None,
) -> LLMEngine:
    """An LLMEngine of the tiny model with the sizes every serving test assumes; `lora` is an
    engine LoRAConfig, or None for a replica without adapters."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, StructuredOutputConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_config(
        EngineConfig(
            structured_output=structured_output or StructuredOutputConfig(),
            model=model_dir,
            device="cpu",
            dtype="float32",
            cache=CacheConfig(
                block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, enable_prefix_caching=enable_prefix_caching
            ),
            scheduler=SchedulerConfig(
                max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256, max_num_seqs=max_num_seqs
            ),
            lora=lora,
        )
    )


@contextmanager
def running_engine_worker(
    world: World, *, lora: LoRAConfig | None = None, max_num_seqs: int = 8, structured_output=None
) -> Iterator[object]:
    """One real engine replica of the world's model (the tiny model's LLMEngine and the Redis loop,
    in a thread of this process), live once this yields. `lora` (an engine LoRAConfig) makes it a
    replica that serves adapters; `max_num_seqs` bounds the sequences it runs at once."""
    import redis

    from engine.worker import EngineWorker, RequestQueue, WorkerSettings

    engine = tiny_engine(
        world.deployment.model_path, lora=lora, max_num_seqs=max_num_seqs, structured_output=structured_output
    )
    client = redis.Redis.from_url(settings.REDIS_URL)
    ws = WorkerSettings(
        model=world.model, prefix=settings.REDIS_PREFIX, heartbeat_interval_s=0.2, idle_block_ms=20
    )
    queue = RequestQueue(
        client,
        prefix=ws.prefix,
        model=ws.model,
        replica_id=ws.replica_id,
        output_ttl_s=ws.output_ttl_s,
        heartbeat_ttl_s=ws.heartbeat_ttl_s,
    )
    worker = EngineWorker(engine, queue, ws)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()

    def beating() -> bool:
        assert thread.is_alive(), "the engine worker stopped before its first heartbeat"
        return client.zscore(replicas_key(ws.prefix, ws.model), ws.replica_id) is not None

    # The web tier refuses a model with no heartbeat (503): wait for the replica's first one.
    wait_until(beating, timeout=30, interval=0.01, what="the engine worker's first heartbeat")
    try:
        yield worker
    finally:
        worker.request_stop()
        worker.request_stop()  # the second call stops at once, failing what is still running
        thread.join(timeout=30)
        client.close()


@pytest.fixture
def engine_worker(world) -> Iterator[object]:
    with running_engine_worker(world) as worker:
        yield worker


@pytest.fixture
def lora_engine_worker(world) -> Iterator[object]:
    """A replica started with LoRA enabled, as `--enable-lora` does."""
    from engine.config import LoRAConfig

    with running_engine_worker(
        world, lora=LoRAConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=16)
    ) as worker:
        yield worker


@pytest.fixture(scope="session")
def reference_llm(served_model_dir):
    """The same model run by the engine offline, without the web tier or Redis: what a served
    greedy answer must equal. No prefix cache, so earlier prompts cannot change its arithmetic."""
    from engine.llm import LLM

    return LLM(
        str(served_model_dir),
        device="cpu",
        dtype="float32",
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )


def offline_outputs(reference_llm, request: GenerateRequest) -> list:
    """The engine's own completions (one per index) of a queued request, run offline."""
    from engine.sampling_params import SamplingParams

    [output] = reference_llm.generate(
        [request.prompt_token_ids], SamplingParams.from_dict(request.sampling_params)
    )
    return sorted(output.outputs, key=lambda o: o.index)


def offline_adapter_outputs(model_dir: str, request: GenerateRequest) -> list[CompletionOutput]:
    """The completions of a queued adapter request, run offline by a fresh LoRA engine (fresh, so
    no adapter of an earlier test is cached under the same tenant, name and version)."""
    from engine.config import LoRAConfig
    from engine.sampling_params import SamplingParams

    engine = tiny_engine(
        model_dir,
        lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=16),
        enable_prefix_caching=False,
    )
    engine.add_request(
        "offline",
        request.prompt_token_ids,
        SamplingParams.from_dict(request.sampling_params),
        tenant=request.tenant,
        lora=request.lora,
    )
    final: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        final += [out for out in engine.step() if out.finished]
    [output] = final
    return sorted(output.outputs, key=lambda o: o.index)


async def queued_requests(model: str) -> list[GenerateRequest]:
    """Every request the web tier queued for `model` (entries stay in the stream once answered)."""
    redis = get_async_redis()
    replicas = sorted(r.decode() for r in await redis.smembers(routes_key(settings.REDIS_PREFIX, model)))
    streams = [requests_stream(settings.REDIS_PREFIX, model)]
    streams += [replica_requests_stream(settings.REDIS_PREFIX, model, r) for r in replicas]
    entries = [entry for stream in streams for entry in await redis.xrange(stream)]
    entries.sort(key=lambda entry: tuple(int(part) for part in entry[0].decode().split("-")))
    return [GenerateRequest.decode(fields) for _, fields in entries]


async def engine_idle(worker) -> object:
    """The replica's own stats once it runs nothing and has every KV block free (the engine drops
    an aborted sequence at its next step)."""

    def idle() -> object:
        stats = worker.stats()
        return stats if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks else None

    return await async_wait_until(
        idle, timeout=10, what="the engine replica to run nothing with every block free"
    )


def cached_prefix_len(prompt_len: int) -> int:
    """Tokens a repeated prompt finds in the prefix cache: its full blocks, never its last token."""
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(autouse=True)
async def _close_executor_connections():
    """Views reach the database from asgiref's executor thread; close that thread's connection so
    the test database can be dropped at the end."""
    yield
    from asgiref.sync import sync_to_async
    from django.db import connections

    await sync_to_async(connections.close_all)()
