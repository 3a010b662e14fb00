"""The engine worker against real Redis and a real engine on a tiny model (CPU).

Most tests share one worker process; the ones about process life (two replicas, SIGKILL, SIGTERM)
start their own. Workers driven in-process (a thread) cover what needs a hand on the engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.protocol import (
    CONSUMER_GROUP,
    DeltaOutput,
    Event,
    GenerateRequest,
    ReplicaStats,
    Usage,
    cancel_message,
    cancel_stream,
    entry_gap,
    output_stream,
    replica_stats_key,
    replicas_key,
    requests_stream,
)
from engine.sampling_params import SamplingParams
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "tiny-chat"
PROMPT = [5, 17, 301, 42, 7, 99, 1024, 3]
NUM_BLOCKS = 64
MAX_MODEL_LEN = 512
PROJECT_ROOT = Path(__file__).resolve().parents[2]

# --- helpers --------------------------------------------------------------------------------------


def new_prefix() -> str:
    return os.environ.get("PAGODA_REDIS_PREFIX", "pagoda-test:") + f"worker-{uuid.uuid4().hex[:10]}:"


def drop_keys(client: redis.Redis, prefix: str) -> None:
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)


def submit(
    client: redis.Redis,
    prefix: str,
    request_id: str,
    prompt: list[int] = PROMPT,
    created_at: float = 0.0,
    **params,
) -> None:
    params.setdefault("temperature", 0.0)
    request = GenerateRequest(
        request_id=request_id,
        model=MODEL,
        prompt_token_ids=prompt,
        sampling_params=params,
        tenant="tenant-a",
        created_at=created_at,
    )
    client.xadd(requests_stream(prefix, MODEL), request.encode())


def events_of(client: redis.Redis, prefix: str, request_id: str) -> list[Event]:
    return [Event.decode(fields) for _, fields in client.xrange(output_stream(prefix, request_id))]


def ended(events: list[Event]) -> bool:
    return bool(events) and events[-1].type in ("finished", "error")


def wait_events(
    client: redis.Redis,
    prefix: str,
    request_id: str,
    until: Callable[[list[Event]], bool] = ended,
    timeout: float = 90.0,
) -> list[Event]:
    seen: list[Event] = []

    def arrived() -> list[Event] | None:
        seen[:] = events_of(client, prefix, request_id)
        return list(seen) if until(seen) else None

    try:
        return wait_until(arrived, timeout=timeout, what=f"the events of {request_id}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; events so far: {seen}") from None


def wait_for(condition: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    return wait_until(condition, timeout=timeout, what=what)


def streamed(events: list[Event], index: int = 0) -> tuple[str, list[int]]:
    outputs = [o for e in events if e.type == "delta" for o in e.outputs if o["index"] == index]
    return "".join(o["text"] for o in outputs), [t for o in outputs for t in o["token_ids"]]


def num_deltas(events: list[Event]) -> int:
    return sum(e.type == "delta" for e in events)


def num_streamed_tokens(events: list[Event]) -> int:
    return sum(len(o["token_ids"]) for e in events if e.type == "delta" for o in e.outputs)


def has_delta(events: list[Event]) -> bool:
    return any(e.type == "delta" for e in events)


def pending(client: redis.Redis, prefix: str) -> int:
    return int(client.xpending(requests_stream(prefix, MODEL), CONSUMER_GROUP)["pending"])


def queue_of(client: redis.Redis, prefix: str, replica_id: str):
    """A replica's Redis side alone, with no worker around it."""
    from engine.worker import RequestQueue

    return RequestQueue(
        client, prefix=prefix, model=MODEL, replica_id=replica_id, output_ttl_s=60, heartbeat_ttl_s=2.0
    )


def taken_by(queue, *request_ids: str) -> list[tuple[bytes, dict]]:
    """Requests submitted and read by one replica's queue (no worker): their entries, in order."""
    queue.ensure_group()
    for request_id in request_ids:
        submit(queue.client, queue.prefix, request_id)
    return queue.read_new(len(request_ids), None)


def stats_of(client: redis.Redis, prefix: str, replica_id: str) -> ReplicaStats | None:
    raw = client.get(replica_stats_key(prefix, MODEL, replica_id))
    return ReplicaStats.decode(raw) if raw else None


class Workers:
    """Engine worker processes on one Redis prefix; every one is killed at teardown."""

    def __init__(self, model_dir: Path, prefix: str, log_dir: Path) -> None:
        self.model_dir, self.prefix, self.log_dir = model_dir, prefix, log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.client = redis.Redis.from_url(REDIS_URL)

    def start(self, replica_id: str, *extra: str) -> subprocess.Popen:
        argv = [
            sys.executable, "-m", "engine.serve",
            "--model-dir", str(self.model_dir), "--served-name", MODEL,
            "--redis-url", REDIS_URL, "--redis-prefix", self.prefix, "--replica-id", replica_id,
            "--device", "cpu", "--dtype", "float32", "--num-blocks", str(NUM_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "256",
            "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2", "--claim-timeout-ms", "1000",
            *extra,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(PROJECT_ROOT))
        log = open(self.log_dir / f"{replica_id}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[replica_id] = proc
        return proc

    def wait_ready(self, replica_id: str, timeout: float = 120.0) -> None:
        proc = self.procs[replica_id]

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"worker {replica_id} exited with {proc.returncode}:\n{self.log(replica_id)}"
                )
            return stats_of(self.client, self.prefix, replica_id) is not None

        wait_for(ready, timeout, f"worker {replica_id} to publish a heartbeat")

    def log(self, replica_id: str) -> str:
        return (self.log_dir / f"{replica_id}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        drop_keys(self.client, self.prefix)
        self.client.close()


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(REDIS_URL)
    yield c
    c.close()


def tiny_engine(
    model_dir: Path,
    max_num_seqs: int | None = None,
    *,
    max_model_len: int = MAX_MODEL_LEN,
    num_blocks: int = NUM_BLOCKS,
):
    """An engine of the workers' shape, in this process."""
    from engine.llm_engine import LLMEngine

    scheduler = {"max_num_seqs": max_num_seqs} if max_num_seqs is not None else {}
    return LLMEngine.from_config(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            cache=CacheConfig(num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=256, **scheduler),
        )
    )


@pytest.fixture(scope="module")
def direct_engine(tiny_llama_dir: Path):
    return tiny_engine(tiny_llama_dir)


def run_directly(engine, request_id: str, prompt: list[int], **params) -> dict[int, tuple[str, list[int]]]:
    engine.add_request(request_id, prompt, SamplingParams(**params))
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = {c.index: (c.text, list(c.token_ids)) for c in output.outputs}
    return final


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """One worker process shared by the tests that do not stop it."""
    workers = Workers(tiny_llama_dir, new_prefix(), tmp_path_factory.mktemp("served-logs"))
    try:
        workers.start("solo", "--max-num-seqs", "4")
        workers.wait_ready("solo")
        yield workers
    finally:
        workers.close()


@pytest.fixture
def workers(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(tiny_llama_dir, new_prefix(), tmp_path)
    try:
        yield w
    finally:
        w.close()


# --- one shared worker ----------------------------------------------------------------------------


def test_streamed_deltas_add_up_to_the_finished_text_and_to_the_engine_run_directly(served, direct_engine):
    c, prefix = served.client, served.prefix
    submit(c, prefix, "greedy-1", max_tokens=24, ignore_eos=True)

    events = wait_events(c, prefix, "greedy-1")

    text, token_ids = streamed(events)
    assert (text, token_ids) == run_directly(direct_engine, "direct-greedy-1", PROMPT, temperature=0.0,
                                             max_tokens=24, ignore_eos=True)[0]  # fmt: skip
    assert len(token_ids) == 24
    finished = events[-1]
    assert finished.type == "finished"
    assert finished.outputs == [{"index": 0, "finish_reason": "length", "stop_reason": None}]
    assert finished.usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 24, "cached_tokens": 0}
    assert finished.replica == "solo"
    assert 0 < c.ttl(output_stream(prefix, "greedy-1")) <= 600
    wait_for(lambda: pending(c, prefix) == 0, 5, "the request to be acked")


def test_the_finished_event_says_when_the_request_was_queued_taken_and_gave_its_first_token(served):
    c, prefix = served.client, served.prefix
    queued = time.time()
    request = GenerateRequest(
        request_id="timed-1",
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"temperature": 0.0, "max_tokens": 4, "ignore_eos": True},
        tenant="tenant-a",
        created_at=queued,
    )
    c.xadd(requests_stream(prefix, MODEL), request.encode())

    events = wait_events(c, prefix, "timed-1")
    ended_at = time.time()

    timing = events[-1].timing
    assert events[-1].type == "finished" and timing is not None
    assert timing["queued"] == queued
    assert queued <= timing["taken"] <= timing["first_token"] <= ended_at
    # The first token's time is that of the step that produced it: no later than its delta's entry
    # (whose id is the time it was written, in ms).
    first_delta_id = c.xrange(output_stream(prefix, "timed-1"), count=1)[0][0].decode()
    assert timing["first_token"] * 1000 <= int(first_delta_id.split("-")[0]) + 1
    assert all(e.timing is None for e in events[:-1])


def test_n2_streams_every_index_and_sums_usage_over_them(served, direct_engine):
    c, prefix = served.client, served.prefix
    submit(c, prefix, "n2-1", n=2, max_tokens=10, ignore_eos=True)

    events = wait_events(c, prefix, "n2-1")

    direct = run_directly(
        direct_engine, "direct-n2-1", PROMPT, n=2, temperature=0.0, max_tokens=10, ignore_eos=True
    )
    assert streamed(events, 0) == direct[0]
    assert streamed(events, 1) == direct[1]
    # One delta event per step, never one per index.
    assert all(len({o["index"] for o in e.outputs}) == len(e.outputs) for e in events if e.type == "delta")
    assert events[-1].outputs == [
        {"index": 0, "finish_reason": "length", "stop_reason": None},
        {"index": 1, "finish_reason": "length", "stop_reason": None},
    ]
    assert events[-1].usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 20, "cached_tokens": 0}


def test_logprobs_travel_with_each_token(served):
    c, prefix = served.client, served.prefix
    submit(c, prefix, "lp-1", max_tokens=5, ignore_eos=True, logprobs=2)

    events = wait_events(c, prefix, "lp-1")

    outputs = [o for e in events if e.type == "delta" for o in e.outputs]
    assert sum(len(o["token_ids"]) for o in outputs) == 5
    for o in outputs:
        assert [entry["token_id"] for entry in o["logprobs"]] == o["token_ids"]
        for entry in o["logprobs"]:
            assert len(entry["top"]) == 2
            # Greedy: the sampled token is the most likely one.
            assert entry["top"][0][0] == entry["token_id"]
            assert entry["logprob"] == pytest.approx(entry["top"][0][1])


def submit_quiet(client: redis.Redis, prefix: str, request_id: str, **params) -> None:
    """A request whose reader answers once (GenerateRequest.stream false), greedy."""
    request = GenerateRequest(
        request_id=request_id,
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"temperature": 0.0, **params},
        tenant="tenant-a",
        stream=False,
    )
    client.xadd(requests_stream(prefix, MODEL), request.encode())


def test_a_quiet_request_gets_its_first_tokens_at_once_and_the_rest_in_few_deltas(served, direct_engine):
    from engine.worker.outputs import QUIET_PUBLISH_S

    c, prefix = served.client, served.prefix
    sent = time.monotonic()
    submit_quiet(c, prefix, "quiet-1", n=2, max_tokens=48, ignore_eos=True, logprobs=2)

    events = wait_events(c, prefix, "quiet-1")
    elapsed = time.monotonic() - sent

    direct = run_directly(
        direct_engine, "direct-quiet-1", PROMPT, n=2, temperature=0.0, max_tokens=48, ignore_eos=True
    )
    assert streamed(events, 0) == direct[0] and streamed(events, 1) == direct[1]
    deltas = [e for e in events if e.type == "delta"]
    # The first step's tokens at once (its replica named), then a delta at most every
    # QUIET_PUBLISH_S and one at the end, instead of one per step (48).
    assert deltas[0].outputs and all(len(o["token_ids"]) == 1 for o in deltas[0].outputs)
    assert deltas[0].replica == "solo"
    assert 2 <= len(deltas) <= 2 + elapsed / QUIET_PUBLISH_S
    assert len(deltas) < 48
    for delta in deltas:
        assert len({o["index"] for o in delta.outputs}) == len(delta.outputs)
        for o in delta.outputs:  # merged deltas keep each token's logprobs beside it
            assert [entry["token_id"] for entry in o["logprobs"]] == o["token_ids"]
    assert events[-1].usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 96, "cached_tokens": 0}


def test_cancel_ends_the_request_with_abort_and_frees_its_blocks(served):
    c, prefix = served.client, served.prefix
    submit(c, prefix, "cancel-1", max_tokens=400, ignore_eos=True)
    wait_events(c, prefix, "cancel-1", until=has_delta)

    c.xadd(cancel_stream(prefix, MODEL), cancel_message("cancel-1"))
    events = wait_events(c, prefix, "cancel-1")

    assert events[-1].type == "finished"
    assert events[-1].outputs == [{"index": 0, "finish_reason": "abort", "stop_reason": None}]
    produced = num_streamed_tokens(events)
    assert 0 < produced < 400
    assert events[-1].usage == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": produced,
        "cached_tokens": 0,
    }
    assert len([e for e in events if e.type == "finished"]) == 1
    stats = wait_for(
        lambda: (
            (s := stats_of(c, prefix, "solo"))
            and s.num_running == 0
            and s.num_free_blocks == NUM_BLOCKS
            and s
        ),
        10,
        "the aborted request's blocks to be free",
    )
    assert stats.num_total_blocks == NUM_BLOCKS
    wait_for(lambda: pending(c, prefix) == 0, 5, "the cancelled request to be acked")


def test_a_cancel_that_arrives_before_the_request_is_taken_still_applies(served):
    c, prefix = served.client, served.prefix
    c.xadd(cancel_stream(prefix, MODEL), cancel_message("cancel-early"))
    # The worker reads cancels after taking requests: once it has answered a request queued after
    # the cancel, it has read the cancel, before the cancelled request exists.
    submit(c, prefix, "after-the-cancel", max_tokens=1)
    wait_events(c, prefix, "after-the-cancel")
    submit(c, prefix, "cancel-early", max_tokens=50, ignore_eos=True)

    events = wait_events(c, prefix, "cancel-early")

    assert [e.type for e in events] == ["finished"]
    assert events[0].outputs == [{"index": 0, "finish_reason": "abort", "stop_reason": None}]
    assert events[0].usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "cached_tokens": 0}


def test_malformed_entries_are_acked_and_answered_when_they_name_a_request(served):
    c, prefix = served.client, served.prefix
    stream = requests_stream(prefix, MODEL)
    c.xadd(stream, {"data": "{not json"})
    c.xadd(stream, {"data": '{"v":1,"request_id":"bad-fields"}'})
    submit(c, prefix, "bad-params", temperature=5.0)
    submit(c, prefix, "good-after", max_tokens=3, ignore_eos=True)

    bad_fields = wait_events(c, prefix, "bad-fields")
    bad_params = wait_events(c, prefix, "bad-params")
    good = wait_events(c, prefix, "good-after")

    assert [(e.type, e.code) for e in bad_fields] == [("error", "invalid_request")]
    assert [(e.type, e.code) for e in bad_params] == [("error", "invalid_request")]
    assert "temperature" in bad_params[0].message
    assert good[-1].type == "finished" and good[-1].usage["completion_tokens"] == 3
    wait_for(lambda: pending(c, prefix) == 0, 5, "every entry to be acked")


def test_a_prompt_longer_than_the_engine_allows_gets_request_too_large(served):
    c, prefix = served.client, served.prefix
    submit(c, prefix, "too-long", prompt=[7] * (MAX_MODEL_LEN + 1), max_tokens=4)

    events = wait_events(c, prefix, "too-long")

    assert [(e.type, e.code) for e in events] == [("error", "request_too_large")]
    assert str(MAX_MODEL_LEN) in events[0].message
    wait_for(lambda: pending(c, prefix) == 0, 5, "the refused request to be acked")


def test_heartbeat_publishes_stats_with_a_ttl(served):
    c, prefix = served.client, served.prefix

    stats = stats_of(c, prefix, "solo")
    ttl_ms = c.pttl(replica_stats_key(prefix, MODEL, "solo"))
    score = c.zscore(replicas_key(prefix, MODEL), "solo")

    assert stats is not None and stats.model == MODEL and stats.replica_id == "solo"
    assert stats.num_total_blocks == NUM_BLOCKS
    assert 0 < ttl_ms <= 2000
    assert score is not None and time.time() - score < 2.0


# --- replicas coming and going --------------------------------------------------------------------


def test_two_replicas_share_one_model_stream(workers):
    c, prefix = workers.client, workers.prefix
    for replica in ("left", "right"):
        # One request at a time each, so the second request must go to the other replica.
        workers.start(replica, "--max-num-seqs", "1", "--max-held", "1")
    workers.wait_ready("left")
    workers.wait_ready("right")
    request_ids = [f"shared-{i}" for i in range(4)]
    for request_id in request_ids:
        submit(c, prefix, request_id, max_tokens=40, ignore_eos=True)

    finals = [wait_events(c, prefix, request_id)[-1] for request_id in request_ids]

    assert [f.type for f in finals] == ["finished"] * 4
    assert [f.usage["completion_tokens"] for f in finals] == [40] * 4
    assert {f.replica for f in finals} == {"left", "right"}
    wait_for(lambda: pending(c, prefix) == 0, 5, "every request to be acked")


def test_a_killed_replicas_requests_are_taken_over_queued_ones_run_and_streaming_ones_continue(
    workers, direct_engine
):
    c, prefix = workers.client, workers.prefix
    # A claim timeout far beyond the test: only the lapsed heartbeat lets the rescuer take over.
    slow_claims = ("--claim-timeout-ms", "600000")
    # One sequence runs at a time and two are taken: the second waits, held but never started.
    workers.start("doomed", "--max-num-seqs", "1", "--max-held", "2", *slow_claims)
    workers.wait_ready("doomed")
    submit(c, prefix, "streaming", max_tokens=480, ignore_eos=True, created_at=time.time())
    wait_events(c, prefix, "streaming", until=has_delta)
    waiting_queued_at = time.time()
    submit(c, prefix, "held-waiting", max_tokens=12, ignore_eos=True, created_at=waiting_queued_at)
    wait_for(lambda: pending(c, prefix) == 2, 10, "the dead-to-be replica to hold both requests")
    assert not ended(events_of(c, prefix, "streaming"))
    assert events_of(c, prefix, "held-waiting") == []

    workers.procs["doomed"].send_signal(signal.SIGKILL)
    workers.procs["doomed"].wait(timeout=30)
    streamed_before = events_of(c, prefix, "streaming")
    submit(c, prefix, "queued-after", max_tokens=6, ignore_eos=True)
    workers.start("rescuer", "--max-num-seqs", "2", *slow_claims)

    streaming = wait_events(c, prefix, "streaming")
    waiting = wait_events(c, prefix, "held-waiting")
    queued = wait_events(c, prefix, "queued-after")

    # The interrupted stream goes on where it was: a failover marker, then the rest of the answer.
    after = streaming[len(streamed_before) :]
    assert streaming[: len(streamed_before)] == streamed_before
    assert (after[0].type, after[0].replica) == ("failover", "rescuer")
    assert [e.type for e in after[1:]] == ["delta"] * (len(after) - 2) + ["finished"]
    text, tokens = streamed(streaming)
    assert (text, tokens) == run_directly(direct_engine, "streaming-direct", PROMPT, temperature=0.0,
                                          max_tokens=480, ignore_eos=True)[0]  # fmt: skip
    assert streaming[-1].usage["prompt_tokens"] == len(PROMPT)
    assert streaming[-1].usage["completion_tokens"] == 480
    assert (waiting[-1].type, waiting[-1].replica, num_streamed_tokens(waiting)) == (
        "finished",
        "rescuer",
        12,
    )
    assert (queued[-1].type, queued[-1].replica, num_streamed_tokens(queued)) == ("finished", "rescuer", 6)
    # The request that had not started waited in the queue from when it was queued; the one that
    # streamed on the lost replica did not (its timing leaves the queue out).
    assert waiting[-1].timing is not None and waiting[-1].timing["queued"] == waiting_queued_at
    assert streaming[-1].timing is not None and streaming[-1].timing["queued"] == 0.0
    assert streaming[-1].timing["taken"] <= streaming[-1].timing["first_token"]
    wait_for(lambda: pending(c, prefix) == 0, 5, "every request to be acked")
    stats = stats_of(c, prefix, "rescuer")
    assert stats is not None and stats.num_resumed_requests == 1
    assert stats.num_resumed_tokens == num_streamed_tokens(streamed_before)


def test_sigterm_drains_the_running_request_takes_nothing_new_and_exits_zero(workers):
    c, prefix = workers.client, workers.prefix
    proc = workers.start("draining")
    workers.wait_ready("draining")
    submit(c, prefix, "in-flight", max_tokens=60, ignore_eos=True)
    wait_events(c, prefix, "in-flight", until=has_delta)

    proc.send_signal(signal.SIGTERM)
    # Two more steps after the signal: the handler ran during the first at the latest, and the loop
    # that made the second no longer reads new requests.
    deltas_at_signal = num_deltas(events_of(c, prefix, "in-flight"))
    wait_events(c, prefix, "in-flight", until=lambda ev: ended(ev) or num_deltas(ev) >= deltas_at_signal + 2)
    submit(c, prefix, "after-stop", max_tokens=4)
    returncode = proc.wait(timeout=60)

    assert returncode == 0, workers.log("draining")
    in_flight = events_of(c, prefix, "in-flight")
    assert in_flight[-1].type == "finished"
    assert in_flight[-1].outputs[0]["finish_reason"] == "length"
    assert num_streamed_tokens(in_flight) == 60
    # The new request stays queued for another replica: never delivered, never answered.
    assert events_of(c, prefix, "after-stop") == []
    assert pending(c, prefix) == 0
    assert c.xlen(requests_stream(prefix, MODEL)) == 2
    # A clean exit removes the heartbeat and the consumer.
    assert c.exists(replica_stats_key(prefix, MODEL, "draining")) == 0
    assert c.zscore(replicas_key(prefix, MODEL), "draining") is None
    assert c.xinfo_consumers(requests_stream(prefix, MODEL), CONSUMER_GROUP) == []


def test_sigterm_hands_back_unstarted_requests_at_once_and_finishes_the_running_one(workers):
    c, prefix = workers.client, workers.prefix
    stream = requests_stream(prefix, MODEL)
    # One sequence runs, two wait behind it; a claim timeout far beyond the test, so nothing but
    # the hand-back can move a request to another consumer.
    proc = workers.start("leaving", "--max-num-seqs", "1", "--max-held", "3", "--claim-timeout-ms", "600000")
    workers.wait_ready("leaving")
    submit(c, prefix, "running", max_tokens=480, ignore_eos=True)
    wait_events(c, prefix, "running", until=has_delta)
    for request_id in ("waiting-1", "waiting-2"):
        submit(c, prefix, request_id, max_tokens=5, ignore_eos=True)
    wait_for(lambda: pending(c, prefix) == 3, 10, "the replica to hold all three requests")

    proc.send_signal(signal.SIGTERM)
    taken: list[tuple[bytes, dict]] = []

    def another_replica_reads_both() -> bool:
        # What another replica's next XREADGROUP '>' gets, without waiting for any reclaim.
        reply = c.xreadgroup(CONSUMER_GROUP, "staying", {stream: ">"}, count=10)
        taken.extend((mid, fields) for _, entries in reply or [] for mid, fields in entries)
        return len(taken) >= 2

    wait_for(another_replica_reads_both, 30, "the unstarted requests to be handed back")
    draining = stats_of(c, prefix, "leaving")
    returncode = proc.wait(timeout=60)

    assert sorted(GenerateRequest.decode(fields).request_id for _, fields in taken) == [
        "waiting-1",
        "waiting-2",
    ]
    # The heartbeat said so while the running request finished.
    assert draining is not None and draining.draining is True
    assert returncode == 0, workers.log("leaving")
    running = events_of(c, prefix, "running")
    assert (running[-1].type, running[-1].replica, num_streamed_tokens(running)) == (
        "finished",
        "leaving",
        480,
    )
    # Never run on the leaving replica: not a token written for them.
    assert events_of(c, prefix, "waiting-1") == events_of(c, prefix, "waiting-2") == []
    # What stays pending is the new consumer's only; the leaving one held nothing when it left.
    rows = c.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10)
    assert sorted(row["message_id"] for row in rows) == sorted(mid for mid, _ in taken)
    assert {row["consumer"] for row in rows} == {b"staying"}
    assert c.zscore(replicas_key(prefix, MODEL), "leaving") is None


def test_a_drain_past_its_grace_period_hands_the_streaming_request_to_the_next_replica(
    workers, direct_engine
):
    c, prefix = workers.client, workers.prefix
    # A grace period of zero: the drain ends at the first look, whatever runs.
    proc = workers.start("hasty", "--max-num-seqs", "1", "--max-held", "2", "--drain-grace-s", "0")
    workers.wait_ready("hasty")
    submit(c, prefix, "cut-short", max_tokens=480, ignore_eos=True)
    wait_events(c, prefix, "cut-short", until=has_delta)
    submit(c, prefix, "queued-behind", max_tokens=5, ignore_eos=True)
    wait_for(lambda: pending(c, prefix) == 2, 10, "the replica to hold both requests")

    proc.send_signal(signal.SIGTERM)
    returncode = proc.wait(timeout=60)

    assert returncode == 0, workers.log("hasty")
    cut = events_of(c, prefix, "cut-short")
    assert [e.type for e in cut] == ["delta"] * len(cut) and num_streamed_tokens(cut) < 480
    # Both are back in the stream, undelivered: the next replica's read takes them. (The last
    # delivered original stays, acked, so that Redis can still tell the group's lag.)
    assert events_of(c, prefix, "queued-behind") == []
    assert pending(c, prefix) == 0
    [group] = c.xinfo_groups(requests_stream(prefix, MODEL))
    assert group["lag"] == 2

    workers.start("next", "--max-num-seqs", "2")
    continued = wait_events(c, prefix, "cut-short")
    behind = wait_events(c, prefix, "queued-behind")

    assert (continued[len(cut)].type, continued[len(cut)].replica) == ("failover", "next")
    assert (
        streamed(continued)
        == run_directly(
            direct_engine, "cut-short-direct", PROMPT, temperature=0.0, max_tokens=480, ignore_eos=True
        )[0]
    )
    assert continued[-1].type == "finished" and continued[-1].usage["completion_tokens"] == 480
    assert [e.type for e in behind] == ["delta"] * (len(behind) - 1) + ["finished"]
    assert num_streamed_tokens(behind) == 5


def test_with_failovers_off_a_drain_past_its_grace_fails_the_streaming_request_with_its_usage(workers):
    c, prefix = workers.client, workers.prefix
    proc = workers.start("hasty", "--max-num-seqs", "1", "--drain-grace-s", "0", "--max-failovers", "0")
    workers.wait_ready("hasty")
    submit(c, prefix, "cut-short", max_tokens=480, ignore_eos=True)
    wait_events(c, prefix, "cut-short", until=has_delta)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, workers.log("hasty")

    cut = events_of(c, prefix, "cut-short")
    assert (cut[-1].type, cut[-1].code, cut[-1].replica) == ("error", "engine_shutdown", "hasty")
    assert cut[-1].usage == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": num_streamed_tokens(cut[:-1]),
        "cached_tokens": 0,
    }


def test_a_handed_back_entry_is_read_at_once_by_another_replica_and_is_no_longer_pending(client):
    prefix = new_prefix()
    stream = requests_stream(prefix, MODEL)
    leaving, staying = queue_of(client, prefix, "leaving"), queue_of(client, prefix, "staying")
    try:
        (first, fields), (second, _), (third, _) = taken_by(leaving, "handed-back", "kept", "reclaimed")
        client.xclaim(stream, CONSUMER_GROUP, "thief", 0, [third.id], justid=True)  # as after a stall

        handed = leaving.hand_back([first, third])

        # Only what the replica still owned went back; the reclaimed entry stays with its new holder.
        assert handed == {first}
        [(new_id, new_fields)] = staying.read_new(10, None)
        # Marked as handed back: its taker looks at its output stream first (it may have streamed).
        assert new_fields == {**fields, b"handed": b"1"} and new_id > third
        rows = client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10)
        assert [(row["message_id"], row["consumer"]) for row in rows] == [
            (second.id, b"leaving"),
            (third.id, b"thief"),
            (new_id.id, b"staying"),
        ]
        # The original is gone from the stream, not left as a second copy of the prompt.
        assert client.xrange(stream, first.id, first.id) == []
        assert leaving.hand_back([]) == set()
    finally:
        drop_keys(client, prefix)


# --- a worker driven in-process, for what needs a hand on the engine ------------------------------


@pytest.fixture
def fresh_engine(tiny_llama_dir: Path):
    def make(max_num_seqs: int = 4):
        return tiny_engine(tiny_llama_dir, max_num_seqs)

    return make


@pytest.fixture
def inproc(client: redis.Redis) -> Iterator[Callable]:
    """Builds EngineWorkers on a fresh prefix; any still running at teardown are stopped."""
    from engine.worker import EngineWorker, RequestQueue, WorkerSettings

    prefix = new_prefix()
    started: list[tuple[EngineWorker, threading.Thread | None]] = []

    def build(engine, **settings) -> EngineWorker:
        settings = {"heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 2.0, "idle_block_ms": 50, **settings}
        ws = WorkerSettings(model=MODEL, prefix=prefix, **settings)
        queue = RequestQueue(
            client,
            prefix=prefix,
            model=MODEL,
            replica_id=ws.replica_id,
            output_ttl_s=ws.output_ttl_s,
            heartbeat_ttl_s=ws.heartbeat_ttl_s,
        )
        worker = EngineWorker(engine, queue, ws)
        started.append((worker, None))
        return worker

    def in_thread(worker) -> threading.Thread:
        result: dict[str, int] = {}
        thread = threading.Thread(target=lambda: result.setdefault("rc", worker.run()), daemon=True)
        thread.result = result  # type: ignore[attr-defined]
        thread.start()
        started.append((worker, thread))
        return thread

    build.prefix = prefix  # type: ignore[attr-defined]
    build.in_thread = in_thread  # type: ignore[attr-defined]
    yield build
    for worker, thread in started:
        if thread is not None and thread.is_alive():
            worker.request_stop()
            worker.request_stop()
            thread.join(timeout=30)
    drop_keys(client, prefix)


def failing_after(engine, *, steps: int):
    """`engine`, whose steps after the first `steps` raise (a device lost)."""
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > steps:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = failing_step
    return engine


def test_an_engine_failure_releases_its_requests_and_another_replica_continues_the_streamed_one(
    client, inproc, fresh_engine, direct_engine
):
    from engine.worker import EXIT_ENGINE_FAILED

    prefix = inproc.prefix
    worker = inproc(failing_after(fresh_engine(max_num_seqs=1), steps=4), replica_id="fragile")
    submit(client, prefix, "was-streaming", max_tokens=100, ignore_eos=True)
    submit(client, prefix, "never-started", max_tokens=5)

    returncode = worker.run()

    assert returncode == EXIT_ENGINE_FAILED
    assert [e.type for e in events_of(client, prefix, "was-streaming")] == ["delta"] * 4
    assert events_of(client, prefix, "never-started") == []
    assert stats_of(client, prefix, "fragile") is None
    # Released: any replica's next reclaim takes them at once, whatever its claim timeout, and
    # counts the delivery (a request that breaks every replica ends after max_deliveries).
    thread = inproc.in_thread(inproc(fresh_engine(), replica_id="steady", claim_timeout_ms=60_000))
    streaming = wait_events(client, prefix, "was-streaming", timeout=60)
    unstarted = wait_events(client, prefix, "never-started", timeout=60)

    assert [(e.type, e.replica) for e in streaming[4:6]] == [("failover", "steady"), ("delta", None)]
    assert (
        streamed(streaming)
        == run_directly(
            direct_engine, "was-streaming-direct", PROMPT, temperature=0.0, max_tokens=100, ignore_eos=True
        )[0]
    )
    assert streaming[-1].usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 100, "cached_tokens": 0}
    assert unstarted[-1].type == "finished" and unstarted[-1].replica == "steady"
    assert thread.is_alive()


def test_a_quiet_request_whose_engine_fails_publishes_what_it_held_back_and_is_continued_from_there(
    client, inproc, fresh_engine, direct_engine
):
    from engine.worker import EXIT_ENGINE_FAILED

    prefix = inproc.prefix
    worker = inproc(failing_after(fresh_engine(max_num_seqs=1), steps=4), replica_id="fragile")
    submit_quiet(client, prefix, "quiet-lost", max_tokens=100, ignore_eos=True)

    assert worker.run() == EXIT_ENGINE_FAILED
    # Its first token at once, then the three held back, published as the replica gave up.
    before = events_of(client, prefix, "quiet-lost")
    assert [(e.type, [len(o["token_ids"]) for o in e.outputs]) for e in before] == [
        ("delta", [1]),
        ("delta", [3]),
    ]
    inproc.in_thread(inproc(fresh_engine(), replica_id="steady", claim_timeout_ms=60_000))
    events = wait_events(client, prefix, "quiet-lost", timeout=60)

    assert events[2].type == "failover" and events[2].replica == "steady"
    assert len(events) < 100  # the continuation is quiet too
    assert (
        streamed(events)
        == run_directly(
            direct_engine, "quiet-lost-direct", PROMPT, temperature=0.0, max_tokens=100, ignore_eos=True
        )[0]
    )
    assert events[-1].usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 100, "cached_tokens": 0}


def test_a_request_lost_more_often_than_max_failovers_ends_with_engine_failed(client, inproc, fresh_engine):
    prefix = inproc.prefix
    stream = requests_stream(prefix, MODEL)
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    submit(client, prefix, "unlucky", max_tokens=50, ignore_eos=True)
    client.xreadgroup(CONSUMER_GROUP, "gone", {stream: ">"})  # its holder then died mid-stream
    out = output_stream(prefix, "unlucky")
    client.xadd(out, Event.delta([DeltaOutput(0, "a", [400, 401])]).encode(), id="1-0")
    client.xadd(out, Event.failover("gone-before").encode(), id="2-0")
    client.xadd(out, Event.delta([DeltaOutput(0, "b", [402])]).encode(), id="2-1")
    inproc.in_thread(inproc(fresh_engine(), replica_id="third", max_failovers=1))

    events = wait_events(client, prefix, "unlucky", timeout=30)

    assert [(e.type, e.code) for e in events[3:]] == [("failover", None), ("error", "engine_failed")]
    assert "lost 2 times" in events[-1].message
    assert events[-1].usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 3, "cached_tokens": 0}


def test_a_takeover_fences_out_what_the_lost_replica_still_writes(client):

    prefix = new_prefix()

    stalled, taker = queue_of(client, prefix, "stalled"), queue_of(client, prefix, "taker")
    try:
        stalled.publish([("fenced", Event.delta([DeltaOutput(0, "x", [400])]))], [])

        seen, marked = taker.take_over("fenced")
        # The stalled replica wakes up and writes its next step, then its end: both refused.
        stalled.publish([("fenced", Event.delta([DeltaOutput(0, "y", [401])]))], [])
        stalled.publish([("fenced", Event.finished([], Usage(len(PROMPT), 2)))], [])
        taker.publish([("fenced", Event.delta([DeltaOutput(0, "z", [402])]))], [])

        events = events_of(client, prefix, "fenced")
        ids = [mid for mid, _ in client.xrange(output_stream(prefix, "fenced"))]
        assert marked and [e.type for e in seen] == ["delta", "failover"]
        assert [(e.type, e.replica) for e in events] == [
            ("delta", None),
            ("failover", "taker"),
            ("delta", None),
        ]
        assert streamed(events) == ("xz", [400, 402])
        assert not any(entry_gap(a, b) for a, b in zip(ids, ids[1:], strict=False))
        # A stream that ended, or that never began, gets no marker.
        assert taker.take_over("never-began") == ([], False)
        taker.publish([("fenced", Event.finished([], Usage(len(PROMPT), 2)))], [])
        assert taker.take_over("fenced")[1] is False
    finally:
        drop_keys(client, prefix)


def test_a_stalled_replica_does_not_ack_an_entry_another_replica_took_over(client):
    prefix = new_prefix()
    stream = requests_stream(prefix, MODEL)
    stalled, taker = queue_of(client, prefix, "stalled"), queue_of(client, prefix, "taker")
    try:
        [(contested, _), (own, _)] = taken_by(stalled, "contested", "own")
        client.xclaim(stream, CONSUMER_GROUP, "taker", 0, [contested.id], justid=True)  # taken over

        # The stalled replica wakes up and acks both as answered: only its own entry is acked.
        stalled.publish([], [contested, own])

        rows = client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10)
        assert [(row["message_id"], row["consumer"]) for row in rows] == [(contested.id, b"taker")]
        taker.publish([], [contested])
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0
    finally:
        drop_keys(client, prefix)


def test_a_replica_whose_heartbeat_lapsed_has_its_requests_claimed_at_once(client):
    from engine.worker.queue import ORPHAN_MIN_IDLE_MS

    prefix = new_prefix()
    stream = requests_stream(prefix, MODEL)

    alive, lapsed, claimer = (queue_of(client, prefix, r) for r in ("alive", "lapsed", "claimer"))
    try:
        alive.ensure_group()
        for request_id in ("of-alive", "of-lapsed"):
            submit(client, prefix, request_id)
        alive.read_new(1, None)
        lapsed.read_new(1, None)
        now = time.time()
        client.zadd(replicas_key(prefix, MODEL), {"alive": now, "lapsed": now - 10})
        assert claimer.claim_orphans(10) == []  # idle for less than ORPHAN_MIN_IDLE_MS yet

        wait_for(lambda: client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 1, consumername="lapsed")[0]
                 ["time_since_delivered"] > ORPHAN_MIN_IDLE_MS, 10, "the lapsed replica's entry to idle")  # fmt: skip
        claimed = claimer.claim_orphans(10)

        assert [GenerateRequest.decode(f).request_id for _, f, _ in claimed] == ["of-lapsed"]
        assert [d for _, _, d in claimed] == [2]
        rows = client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10)
        assert sorted(row["consumer"] for row in rows) == [b"alive", b"claimer"]
    finally:
        drop_keys(client, prefix)


def test_a_restarted_replica_resumes_what_its_previous_process_held(client, inproc, fresh_engine):
    prefix = inproc.prefix
    stream = requests_stream(prefix, MODEL)
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    submit(client, prefix, "left-behind", max_tokens=5, ignore_eos=True)
    client.xreadgroup(CONSUMER_GROUP, "phoenix", {stream: ">"})  # taken by a process that then died
    # A claim timeout far beyond the test: only the replica's own restart can pick it up.
    thread = inproc.in_thread(inproc(fresh_engine(), replica_id="phoenix", claim_timeout_ms=600_000))

    events = wait_events(client, prefix, "left-behind", timeout=30)

    assert events[-1].type == "finished" and num_streamed_tokens(events) == 5
    assert thread.is_alive()


def test_a_live_replica_keeps_its_long_requests_from_being_reclaimed(client, inproc, tiny_llama_dir):
    prefix = inproc.prefix
    stream = requests_stream(prefix, MODEL)
    # The replica touches its entries every third of the claim timeout: only a stall of two thirds
    # of it (2.7 s, far beyond a step of this model on a loaded machine; a 1 s stall was seen on a
    # busy CI machine with a 1.5 s timeout) could let the thief in. Four requests of 1,500 tokens
    # run one at a time (one sequence at once), so the last waits, held, for three runs and the
    # whole takes several times the claim timeout on any machine (one run took 3.6 s on a 2-core
    # machine, 14 s all four).
    engine = tiny_engine(tiny_llama_dir, 1, max_model_len=2048, num_blocks=128)
    inproc.in_thread(inproc(engine, replica_id="busy", claim_timeout_ms=4000))
    runners = [f"long-runner-{i}" for i in range(4)]
    for request_id in runners:
        submit(client, prefix, request_id, max_tokens=1500, ignore_eos=True)
    wait_events(client, prefix, runners[0], until=has_delta)

    stolen = []

    def steal_until_they_end() -> bool:
        if all(ended(events_of(client, prefix, r)) for r in runners):
            return True
        _, claimed, _ = client.xautoclaim(stream, CONSUMER_GROUP, "thief", 4000, "0-0")
        stolen.extend(claimed)
        return False

    started = time.monotonic()
    wait_until(steal_until_they_end, timeout=600, interval=0.05, what="the long requests to finish")
    ran_for = time.monotonic() - started

    assert stolen == []
    for request_id in runners:
        events = events_of(client, prefix, request_id)
        assert events[-1].type == "finished" and num_streamed_tokens(events) == 1500
    assert ran_for > 4.0, "the requests must outlive the claim timeout for this test to mean anything"


def test_a_replica_that_lost_a_request_to_a_reclaim_stops_answering_it(client, inproc, fresh_engine):
    prefix = inproc.prefix
    stream = requests_stream(prefix, MODEL)
    engine = fresh_engine()
    inproc.in_thread(inproc(engine, replica_id="stalled", claim_timeout_ms=300))
    submit(client, prefix, "taken-away", max_tokens=400, ignore_eos=True)
    wait_events(client, prefix, "taken-away", until=has_delta)

    # As another replica does when this one looked dead: the entry is now the thief's, which keeps
    # it alive (touching it) from then on.
    _, claimed, _ = client.xautoclaim(stream, CONSUMER_GROUP, "thief", 0, "0-0")
    assert len(claimed) == 1
    message_id = claimed[0][0]
    counts = []
    # A passage of time, not a synchronisation: that nothing more is written can only be watched.
    for _ in range(15):  # 1.5 s: several touch intervals of the stalled replica
        client.xclaim(stream, CONSUMER_GROUP, "thief", 0, [message_id], justid=True)
        counts.append(len(events_of(client, prefix, "taken-away")))
        time.sleep(0.1)

    # It stops within one touch interval (100 ms), then writes nothing more.
    assert len(set(counts[5:])) == 1
    assert not ended(events_of(client, prefix, "taken-away"))
    assert client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10)[0]["consumer"] == b"thief"
    wait_for(lambda: engine.get_stats()["num_free_blocks"] == NUM_BLOCKS, 5, "the dropped request's blocks")


def test_the_first_delta_names_the_replica_holding_the_request(client, inproc, fresh_engine):
    prefix = inproc.prefix
    inproc.in_thread(inproc(fresh_engine(), replica_id="holder"))
    submit(client, prefix, "tagged", max_tokens=6, ignore_eos=True)
    wait_events(client, prefix, "tagged", until=ended)

    deltas = [e for e in events_of(client, prefix, "tagged") if e.type == "delta"]
    assert deltas[0].replica == "holder"
    assert all(e.replica is None for e in deltas[1:])


def test_an_output_stream_gets_its_ttl_on_its_first_and_last_entries_not_on_every_token(client):
    from engine.protocol import DeltaOutput, FinishedOutput, Usage
    from engine.worker import RequestQueue

    prefix = new_prefix()
    queue = RequestQueue(
        client, prefix=prefix, model=MODEL, replica_id="r", output_ttl_s=60, heartbeat_ttl_s=2.0
    )
    key = output_stream(prefix, "ttl")
    try:
        queue.publish([("ttl", Event.delta([DeltaOutput(index=0, text="a", token_ids=[1])]))], [])
        assert 0 < client.ttl(key) <= 60
        # given the TTL removed behind the replica's back, a next token within the refresh period
        # does not set it again (one EXPIRE per stream per refresh period, not one per step)
        client.persist(key)
        queue.publish([("ttl", Event.delta([DeltaOutput(index=0, text="b", token_ids=[2])]))], [])
        assert client.ttl(key) == -1
        # the last entry sets it: a finished stream stays replayable for a whole TTL after its end
        finished = Event.finished([FinishedOutput(index=0, finish_reason="stop")], Usage(3, 2))
        queue.publish([("ttl", finished)], [])
        assert 0 < client.ttl(key) <= 60
        assert [e.type for e in events_of(client, prefix, "ttl")] == ["delta", "delta", "finished"]
    finally:
        drop_keys(client, prefix)


class CountedWorker:
    """A replica whose loop thread's sends to Redis are counted (commands, or pipelines, each one
    round trip): `at_steps` holds the count at each engine step, `blocked_at` the count once each
    blocking read of new requests was sent. Timers (touch, heartbeat, reclaim) are set far off."""

    def __init__(self, inproc, fresh_engine, *, idle_block_ms: int) -> None:
        from engine.worker import EngineWorker, RequestQueue, WorkerSettings

        self.sends = 0
        self.at_steps: list[int] = []
        self.blocked_at: list[int] = []
        pool = redis.ConnectionPool.from_url(REDIS_URL)
        counter = self
        self.loop_thread: int | None = None

        class Counting(pool.connection_class):  # type: ignore[name-defined, misc]
            def send_packed_command(self, command, check_health=True):
                result = super().send_packed_command(command, check_health)
                if threading.get_ident() == counter.loop_thread:
                    counter.sends += 1
                    packed = b"".join(command) if isinstance(command, list) else command
                    if b"XREADGROUP" in packed and b"BLOCK" in packed:
                        counter.blocked_at.append(counter.sends)
                return result

        pool.connection_class = Counting
        self.client = redis.Redis(connection_pool=pool)
        settings = WorkerSettings(
            model=MODEL,
            prefix=inproc.prefix,
            replica_id="counted",
            claim_timeout_ms=600_000,
            heartbeat_interval_s=60.0,
            heartbeat_ttl_s=120.0,
            idle_block_ms=idle_block_ms,
        )
        queue = RequestQueue(
            self.client,
            prefix=inproc.prefix,
            model=MODEL,
            replica_id="counted",
            output_ttl_s=60,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
        )
        engine = fresh_engine()
        real_step = engine.step

        def step():
            self.at_steps.append(self.sends)
            return real_step()

        engine.step = step
        self.worker = EngineWorker(engine, queue, settings)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop_thread = threading.get_ident()
        self.worker.run()

    def __enter__(self) -> CountedWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.request_stop()
        self.worker.request_stop()
        self.thread.join(timeout=30)
        self.client.close()


def test_between_two_steps_a_running_replica_makes_one_round_trip_to_redis(client, inproc, fresh_engine):
    """A step's events, the acks, the read of new requests and the read of cancels for the next
    step go in one pipeline: while a request runs, the replica's loop makes one round trip between
    two steps (not one per read)."""
    with CountedWorker(inproc, fresh_engine, idle_block_ms=50) as counted:
        submit(client, inproc.prefix, "one", max_tokens=24, ignore_eos=True)
        events = wait_events(client, inproc.prefix, "one", timeout=60)
    assert num_streamed_tokens(events) == 24
    assert len(counted.at_steps) == 24  # one prompt step, then a decode step per token
    gaps = [b - a for a, b in zip(counted.at_steps, counted.at_steps[1:], strict=False)]
    assert gaps == [1] * 23


def test_a_replica_woken_by_a_request_steps_without_another_round_trip(client, inproc, fresh_engine):
    """An idle replica blocks on its request streams; the read of cancels goes in the same round
    trip, after the blocking read, so the request that woke it is stepped at once (a cancel read
    of its own made a second round trip first)."""
    with CountedWorker(inproc, fresh_engine, idle_block_ms=5_000) as counted:
        wait_until(lambda: counted.blocked_at, timeout=30, what="a blocking read of the streams")
        submit(client, inproc.prefix, "woke", max_tokens=2, ignore_eos=True)
        events = wait_events(client, inproc.prefix, "woke", timeout=60)
    assert num_streamed_tokens(events) == 2
    # The request came during the first blocking read (it blocks for seconds, far longer than this
    # takes): nothing was sent between that read and the first step.
    assert counted.blocked_at[0] == counted.at_steps[0]
