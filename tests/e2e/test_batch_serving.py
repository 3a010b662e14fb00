"""The Batch API through the whole stack: daphne, an engine replica of SmolLM2-135M-Instruct, a Celery
worker on the `batches` queue and Celery beat, all real processes, driven by the official openai SDK.
A batch's greedy answers equal the same requests sent interactively; bad lines land in the error
file and do not fail the batch; cancel, the completion window, another tenant's files and batches
(404), the ledger (batch id, price factor); and a worker killed mid-batch: the batch completes and
no line reached the engines twice."""

from __future__ import annotations

import io
import json
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from django.conf import settings

from batches.models import Batch, BatchRequest
from core.redis_client import get_redis
from tenants.models import UsageRecord
from tests.e2e.processes import Process, spawn, start_web
from tests.e2e.stack import ServingStack, served_world
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.real_model, pytest.mark.django_db]

MODEL = "smollm2-batch"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello."]


@dataclass
class Platform:
    stack: ServingStack
    client: openai.OpenAI
    other: openai.OpenAI  # tenant B's
    env: dict[str, str]
    log_dir: Path
    workers: list[Process]

    def start_worker(self, name: str) -> Process:
        argv = [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "batches,celery",
                "--pool=solo", "--loglevel=info", "--without-gossip", "--without-mingle", "--without-heartbeat",
                "-n", f"{name}@%h"]  # fmt: skip
        worker = spawn(name, argv, self.log_dir / f"{name}.log", **self.env)
        self.workers.append(worker)
        return worker


@pytest.fixture(scope="module")
def platform(committed_db, smollm2_dir: Path, tmp_path_factory) -> Iterator[Platform]:
    media = tmp_path_factory.mktemp("batch-media")
    env = {
        "PAGODA_MEDIA_DIR": str(media),
        # A dead runner's lease outlives its owner key (and a settler sweep): the settler finds its
        # lines abandoned before the next runner reads them, and must leave them running.
        "PAGODA_BATCH_RUNNER_LEASE_S": "6",
        "PAGODA_OWNER_TTL_S": "2",
        "PAGODA_SETTLER_SWEEP_S": "1",
        "PAGODA_BATCH_RESUME_EVERY_SECONDS": "1",
        "PAGODA_BATCH_MAX_IN_FLIGHT": "4",
        "OMP_NUM_THREADS": "1",
    }
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["solo"],
        max_model_len=512,
        model=MODEL,
        model_dir=smollm2_dir,
        engine_settings={"num_blocks": 256, "max_num_seqs": 8},
        env=env,
        tenant_a={"name": "Batches", "slug": "e2e-batches"},
        tenant_b={"name": "Other", "slug": "e2e-batches-other", "allowed_models": [MODEL]},
    ) as (base, stack):
        log_dir = tmp_path_factory.mktemp("batch-workers")
        platform = Platform(
            stack, stack.client(base.raw_key_a, timeout=120), stack.client(base.raw_key_b), env, log_dir, []
        )
        beat = spawn(
            "celery-beat",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "beat",
                "--loglevel=info",
                f"--schedule={log_dir / 'beat-schedule'}",
            ],  # fmt: skip
            log_dir / "beat.log",
            **env,
        )
        platform.start_worker("worker-1")
        try:
            yield platform
        finally:
            for process in [beat, *platform.workers]:
                process.stop(grace_s=5)


def _chat_line(custom_id: str, question: str, max_tokens: int = 12) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def _upload(client: openai.OpenAI, lines: list) -> str:
    data = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return client.files.create(file=("input.jsonl", io.BytesIO(data.encode())), purpose="batch").id


def _wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 600):
    return wait_until(
        lambda: (
            (b := client.batches.retrieve(batch_id)).status in ("completed", "failed", "expired", "cancelled")
            and b
        ),
        timeout=timeout,
        interval=0.5,
        what=f"batch {batch_id} to end",
    )


def _jsonl(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    return {row["custom_id"]: row for row in map(json.loads, text.splitlines())}


def test_a_batch_answers_as_interactive_requests_do_with_bad_lines_in_the_error_file(
    platform: Platform,
) -> None:
    client = platform.client
    lines = [_chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    lines += [
        "{not json",
        {**_chat_line("wrong-url", "hi"), "url": "/v1/completions"},
        {**_chat_line("bad-body", "hi"), "body": {"model": MODEL, "messages": [], "max_tokens": -1}},
        _chat_line("q0", "duplicate id"),
        {**_chat_line("no-model", "hi"), "body": {**_chat_line("x", "hi")["body"], "model": "nope"}},
    ]
    file_id = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "1"}
    )
    assert batch.status == "validating" and batch.metadata == {"run": "1"}
    done = _wait_done(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 4, 5)
    outputs, errors = _jsonl(client, done.output_file_id), _jsonl(client, done.error_file_id)
    assert sorted(outputs) == ["q0", "q1", "q2", "q3"]
    for i, question in enumerate(QUESTIONS):
        interactive = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
        )
        response = outputs[f"q{i}"]["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["choices"][0]["message"]["content"] == interactive.choices[0].message.content
        assert response["body"]["usage"]["completion_tokens"] == interactive.usage.completion_tokens
    assert errors["wrong-url"]["error"]["code"] == "mismatched_url"
    assert errors["bad-body"]["response"]["status_code"] == 400
    assert errors["no-model"]["response"]["status_code"] == 404
    assert errors["no-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert [row["error"]["code"] for row in errors.values() if row["custom_id"] == "q0"] == [
        "duplicate_custom_id"
    ]
    assert errors[None]["error"]["code"] == "invalid_json"
    # The ledger: one row per line that ran, with its batch, at the batch price factor.
    rows = UsageRecord.objects.filter(batch_id=batch.id, status="success")
    assert rows.count() == 4
    assert {str(r.price_factor) for r in rows} == {"0.500"} and {r.service_tier for r in rows} == {"flex"}
    assert batch.id in [b.id for b in client.batches.list(limit=5).data]


def test_the_batches_worker_loaded_the_models_tokenizer_once_ready(platform: Platform) -> None:
    log = platform.log_dir / "worker-1.log"
    wait_until(
        lambda: "batch runner warm: 1 tokenizers loaded" in log.read_text(errors="replace"),
        timeout=120,
        what="the worker's warm-up",
    )


def test_another_tenants_files_and_batches_are_not_found(platform: Platform) -> None:
    file_id = _upload(platform.client, [_chat_line("a", "hi")])
    batch = platform.client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: platform.other.files.retrieve(file_id),
        lambda: platform.other.files.content(file_id),
        lambda: platform.other.files.delete(file_id),
        lambda: platform.other.batches.retrieve(batch.id),
        lambda: platform.other.batches.cancel(batch.id),
        lambda: platform.other.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in platform.other.files.list().data]
    _wait_done(platform.client, batch.id)


def test_cancel_stops_feeding_lines_at_once(platform: Platform) -> None:
    client = platform.client
    file_id = _upload(client, [_chat_line(f"c{i}", QUESTIONS[i % 4], max_tokens=48) for i in range(24)])
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, timeout=300, interval=0.2
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _wait_done(client, batch.id)
    assert done.status == "cancelled"
    counts = done.request_counts
    assert counts.completed < 24 and counts.completed + counts.failed == counts.total == 24
    errors = _jsonl(client, done.error_file_id)
    assert {row["error"]["code"] for row in errors.values()} == {"batch_cancelled"}
    # Nothing was fed after the cancel beyond the lines in flight (at most 4 at once).
    ran = BatchRequest.objects.filter(batch_id=batch.id, attempt__gt=0).count()
    assert ran <= counts.completed + 4


def test_past_its_window_a_batch_expires_with_what_finished_delivered(platform: Platform, tmp_path) -> None:
    # A web process whose completion window is 4 seconds, beside the other one.
    web, base_url = start_web(
        log_path=tmp_path / "web-short.log", **platform.env, PAGODA_BATCH_COMPLETION_WINDOW_S="4"
    )
    try:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=platform.client.api_key, max_retries=0)
        file_id = _upload(client, [_chat_line(f"e{i}", QUESTIONS[i % 4], max_tokens=64) for i in range(40)])
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = _wait_done(client, batch.id)
        outputs, errors = _jsonl(client, done.output_file_id), _jsonl(client, done.error_file_id)
    finally:
        web.stop()
    assert done.status == "expired" and done.expired_at is not None
    counts = done.request_counts
    assert counts.completed + counts.failed == counts.total == 40 and counts.failed > 0
    assert len(outputs) == counts.completed and len(errors) == counts.failed
    assert {row["error"]["code"] for row in errors.values()} == {"batch_expired"}


def test_a_worker_killed_mid_batch_is_replaced_and_no_line_runs_twice(platform: Platform) -> None:
    client = platform.client
    lines = [_chat_line(f"k{i}", QUESTIONS[i % 4], max_tokens=32) for i in range(16)]
    file_id = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def running() -> dict[int, int]:
        """Lines whose attempt reached the engines and has not finished: {index: attempt}."""
        if Batch.objects.get(id=batch.id).completed < 2:
            return {}
        rows = BatchRequest.objects.filter(batch_id=batch.id, status="pending", attempt__gt=0)
        redis = get_redis()
        return {
            index: attempt
            for index, attempt in rows.values_list("index", "attempt")
            if redis.exists(f"{settings.REDIS_PREFIX}submitted:{batch.id}-{index}-{attempt}")
        }

    in_flight = wait_until(running, timeout=300, interval=0.05, what="lines in flight after two finished")
    [worker] = [w for w in platform.workers if w.popen.poll() is None]
    worker.popen.send_signal(signal.SIGKILL)
    worker.popen.wait(timeout=30)
    assert client.batches.retrieve(batch.id).request_counts.completed < 16
    platform.start_worker("worker-2")
    done = _wait_done(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 16
    outputs = _jsonl(client, done.output_file_id)
    assert sorted(outputs) == sorted(f"k{i}" for i in range(16))
    # The lines the dead worker had queued were answered by that attempt (read back by its
    # successor, or finished before the kill), not run again.
    for index, attempt in in_flight.items():
        assert outputs[f"k{index}"]["response"]["request_id"] == f"{batch.id}-{index}-{attempt}"
    # Each line reached the engines once: one queued engine request, one billed run.
    redis = get_redis()
    queued = [k.decode() for k in redis.scan_iter(match=f"{settings.REDIS_PREFIX}submitted:{batch.id}-*")]
    per_line = {}
    for key in queued:
        index = int(key.rsplit("-", 2)[-2])
        per_line[index] = per_line.get(index, 0) + 1
    assert per_line == {i: 1 for i in range(16)}
    # The lines the dead worker had queued are billed by a settler, from the engines' records,
    # once its owner key has lapsed (PAGODA_OWNER_TTL_S) and a sweep has run: wait for them.
    ran = UsageRecord.objects.filter(batch_id=batch.id, prompt_tokens__gt=0)
    wait_until(lambda: ran.count() >= 16, timeout=120, interval=0.5, what="every line billed")
    billed = sorted(ran.values_list("request_id", flat=True))
    assert billed == sorted(outputs[f"k{i}"]["response"]["request_id"] for i in range(16))
    assert Batch.objects.get(id=batch.id).completed == 16
