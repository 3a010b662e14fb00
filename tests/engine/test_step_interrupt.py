"""A spare-capacity step given up between layers when a more important request arrives
(engine.step_interrupt, engine.worker.arrivals): nothing of it is kept, the tokens are those of an
engine that never gives a step up, nothing leaks; only steps of the flex tier alone are given up;
the replica's watch tells a more important entry from a flex one, against a real Redis."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
import redis

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest, replica_requests_stream, requests_stream
from engine.rules import SERVICE_TIER_PRIORITY
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSequence
from engine.sequence import Sequence
from engine.step_interrupt import StepInterrupted, checker, interruptible
from engine.worker.arrivals import ArrivalWatch, more_important
from tests.engine.test_worker import (
    MODEL,
    PROMPT,
    REDIS_URL,
    Workers,
    drop_keys,
    ended,
    events_of,
    new_prefix,
    num_streamed_tokens,
    run_directly,
    stats_of,
    streamed,
    tiny_engine,
    wait_events,
)
from tests.helpers import wait_until

FLEX = SERVICE_TIER_PRIORITY["flex"]
DEFAULT = SERVICE_TIER_PRIORITY["default"]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(num_blocks=128, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16),
            warm_up=False,
        )
    )


def _prompt(i: int) -> list[int]:
    return [3 + i, 5 + 2 * i, 7, 11 + i, 13, 2 + i]


def _finish(engine: LLMEngine, tokens: dict[str, list[int]], interrupt_every: int = 0) -> None:
    """Steps until every request ends; with `interrupt_every`, a more important arrival is signalled
    before every such step (as if it arrived while the step ran)."""
    arrived = engine.arrived
    n = 0
    while engine.has_unfinished_requests():
        n += 1
        if arrived is not None:
            arrived.clear()
            if interrupt_every and n % interrupt_every == 0:
                arrived.set()
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)


def _flex_run(engine: LLMEngine, interrupt_every: int = 0) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i in range(6):
        engine.add_request(f"line-{i}", _prompt(i), GREEDY, tenant="batch", priority=FLEX)
    _finish(engine, tokens, interrupt_every)
    return tokens


def test_only_steps_of_the_spare_capacity_tier_alone_and_without_drafts_are_interruptible():
    def item(priority: int, draft: list[int] | None = None) -> ScheduledSequence:
        seq = Sequence(f"r{priority}", [1, 2, 3], GREEDY, tenant="t", priority=priority)
        return ScheduledSequence(seq, 1 + len(draft or []), draft or [])

    assert interruptible([item(FLEX), item(FLEX)])
    assert not interruptible([item(FLEX), item(DEFAULT)])
    assert not interruptible([item(FLEX, draft=[4, 5])])
    assert not interruptible([])
    arrived = threading.Event()
    check = checker(arrived)
    check()  # nothing arrived: the step goes on
    arrived.set()
    with pytest.raises(StepInterrupted):
        check()


@pytest.mark.parametrize("one_call_layers", [True, False], ids=["one-call-layers", "layer-by-layer"])
def test_a_given_up_step_keeps_nothing_the_tokens_are_those_of_an_engine_that_never_gives_one_up(
    tiny_llama_dir: Path, one_call_layers: bool
):
    plain = _flex_run(_engine(tiny_llama_dir))
    engine = _engine(tiny_llama_dir)
    if not one_call_layers:
        engine.runner.model._decode_layers = None  # the torch layers, checked between them too
    engine.enable_step_interrupts()
    interrupted = _flex_run(engine, interrupt_every=3)
    # Every third step was given up after its first layer (its KV written for that layer, its
    # prompt chunk or decodes not taken): the same tokens, and no block left behind.
    assert engine.num_interrupted_steps > 3
    assert interrupted == plain and len(plain) == 6
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert engine.load().num_interrupted_steps == engine.num_interrupted_steps


def test_a_step_with_a_more_important_sequence_in_it_is_never_given_up(tiny_llama_dir: Path):
    engine = _engine(tiny_llama_dir)
    arrived = engine.enable_step_interrupts()
    tokens: dict[str, list[int]] = {}
    longer = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
    for i in range(3):
        engine.add_request(f"line-{i}", _prompt(i), longer, tenant="batch", priority=FLEX)
    engine.add_request("chat", _prompt(9), GREEDY, tenant="chat", priority=DEFAULT)
    arrived.set()
    # The chat request runs until it ends: no step it is in is given up, though the event stays
    # set; the flex lines' steps after it are.
    while "chat" not in tokens:
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    assert engine.num_interrupted_steps == 0
    assert len(tokens["chat"]) == 10
    engine.step()
    assert engine.num_interrupted_steps == 1
    arrived.clear()
    _finish(engine, tokens)
    assert sorted(tokens) == ["chat", "line-0", "line-1", "line-2"]


def _entry(request_id: str, priority: int, max_tokens: int = 16) -> dict:
    """A request entry as the web tier queues it: greedy, EOS ignored, a batch line's tenant for
    the flex tier and a chat tenant's otherwise."""
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return GenerateRequest(
        request_id=request_id, model=MODEL, prompt_token_ids=PROMPT, sampling_params=params,
        tenant="batch" if priority == FLEX else "chat", priority=priority,
    ).encode()  # fmt: skip


def test_an_entry_is_more_important_by_its_tier():
    assert more_important(_entry("a", DEFAULT))
    assert more_important(_entry("b", SERVICE_TIER_PRIORITY["priority"]))
    assert not more_important(_entry("c", FLEX))
    assert not more_important({b"data": b"not json"})
    assert not more_important({})


def test_the_replica_watch_is_set_by_a_more_important_entry_in_either_of_its_streams_not_a_flex_one():
    prefix = new_prefix()
    # Named, so that the watch's own connection (from this client's pool) is known in CLIENT LIST.
    name = prefix.replace(":", "-").rstrip("-")
    client = redis.Redis.from_url(REDIS_URL, client_name=name)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("Redis is not reachable")
    shared, own = requests_stream(prefix, MODEL), replica_requests_stream(prefix, MODEL, "left")
    arrived = threading.Event()
    watch = ArrivalWatch(client, [own, shared], arrived).start()
    try:
        # The watch reads from entries added after it started: wait until its first read blocks.
        wait_until(
            lambda: any(c.get("name") == name and c.get("cmd") == "xread" for c in client.client_list()),
            what="the watch's read",
        )
        client.xadd(shared, _entry("line", FLEX))
        wait_until(lambda: watch.num_read == 1, what="the flex entry read")
        assert not arrived.is_set()
        client.xadd(own, _entry("chat", DEFAULT))
        wait_until(arrived.is_set, what="the more important entry seen")
        assert (watch.num_read, watch.num_seen) == (2, 1)
        arrived.clear()
        client.xadd(shared, _entry("chat-2", DEFAULT))
        wait_until(arrived.is_set, what="the second one, in the shared stream")
        assert watch.num_seen == 2
    finally:
        watch.stop()
        drop_keys(client, prefix)
        client.close()


@pytest.fixture
def workers(tiny_llama_dir: Path, tmp_path: Path):
    w = Workers(tiny_llama_dir, new_prefix(), tmp_path)
    try:
        yield w
    finally:
        w.close()


def test_a_replica_gives_up_batch_steps_for_interactive_arrivals_and_every_request_ends_whole(
    workers: Workers, tiny_llama_dir: Path
):
    """A worker process with flex requests decoding: default-tier requests sent one after another
    are read while a flex step runs, which is given up; every request ends with its whole output,
    the flex ones with the tokens the engine run directly gives."""
    client = workers.client
    workers.start("solo", "--max-num-seqs", "8")
    workers.wait_ready("solo")
    stream = requests_stream(workers.prefix, MODEL)

    def send(request_id: str, priority: int, max_tokens: int) -> None:
        client.xadd(stream, _entry(request_id, priority, max_tokens))

    for i in range(6):
        send(f"line-{i}", FLEX, 400)
    wait_events(client, workers.prefix, "line-0", until=lambda events: num_streamed_tokens(events) >= 5)
    sent = 0

    def interrupted() -> bool:
        nonlocal sent
        stats = stats_of(client, workers.prefix, "solo")
        if stats is not None and stats.num_interrupted_steps > 0:
            return True
        if sent < 100 and not ended(events_of(client, workers.prefix, "line-0")):
            sent += 1
            send(f"chat-{sent}", DEFAULT, 2)
            wait_events(client, workers.prefix, f"chat-{sent}")
        return False

    wait_until(interrupted, timeout=120, what="a flex step given up for an interactive arrival")
    for k in range(1, sent + 1):
        assert num_streamed_tokens(wait_events(client, workers.prefix, f"chat-{k}")) == 2
    expected = run_directly(
        tiny_engine(tiny_llama_dir), "direct", PROMPT, temperature=0.0, max_tokens=400, ignore_eos=True
    )
    for i in range(6):
        events = wait_events(client, workers.prefix, f"line-{i}")
        assert streamed(events)[1] == expected[0][1]


def test_a_draining_replica_finishes_its_batch_lines_though_interactive_requests_keep_arriving(
    workers: Workers,
):
    """A draining replica reads nothing new: an interactive request queued meanwhile must not keep
    giving up its flex steps (it would, with the event never cleared, until the grace period ran
    out and the lines were handed back unfinished)."""
    client = workers.client
    proc = workers.start("draining", "--max-num-seqs", "8", "--drain-grace-s", "60")
    workers.wait_ready("draining")
    stream = requests_stream(workers.prefix, MODEL)

    def send(request_id: str, priority: int, max_tokens: int) -> None:
        client.xadd(stream, _entry(request_id, priority, max_tokens))

    for i in range(4):
        send(f"line-{i}", FLEX, 300)
    # Every line running (their prompts may take a step each: engine.step_width.spare_prompt_tokens):
    # a line that has not started when the drain begins is handed back, not finished here.
    for i in range(4):
        wait_events(
            client, workers.prefix, f"line-{i}", until=lambda events: num_streamed_tokens(events) >= 3
        )
    proc.send_signal(signal.SIGTERM)

    def draining() -> bool:
        stats = stats_of(client, workers.prefix, "draining")
        return stats is not None and stats.draining

    # A read already under way when the signal lands may still bring in what is queued meanwhile;
    # from the heartbeat that says so, the replica reads nothing new.
    wait_until(draining, timeout=60, what="the heartbeat to say the replica drains")
    send("chat-after-stop", DEFAULT, 4)
    assert proc.wait(timeout=60) == 0, workers.log("draining")
    for i in range(4):
        events = events_of(client, workers.prefix, f"line-{i}")
        assert events[-1].type == "finished" and num_streamed_tokens(events) == 300
    assert events_of(client, workers.prefix, "chat-after-stop") == []  # left for another replica
