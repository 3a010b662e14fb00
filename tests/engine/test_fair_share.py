"""Weighted fair share of service across tenants (virtual token counters), priority tiers and queue
deadlines, on the real scheduler (and the engine for the deadline's error)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.fair_share import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST, ServiceCounters
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.worker.outputs import HeldRequest, events_for_output
from engine.worker.queue import EntryRef


@dataclass
class Params:
    max_tokens: int
    n: int = 1
    prompt_logprobs: int | None = None


def _scheduler(*, max_num_seqs: int = 2, budget: int = 64, num_blocks: int = 512, policy: str = "fair"):
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=256, policy=policy
        ),
        CacheConfig(block_size=4),
        num_blocks=num_blocks,
    )


class Run:
    """Steps a scheduler with fake tokens, finishing sequences at max_tokens, and measures the
    service (prompt tokens computed + 2 x output tokens) each tenant received."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.served: Counter[str] = Counter()
        self.admitted: list[Sequence] = []

    def step(self) -> None:
        sched = self.sched
        out = sched.schedule()
        for item in out.scheduled:
            seq = item.seq
            if seq not in self.admitted:
                self.admitted.append(seq)
            prompt = max(0, min(item.start_pos + item.num_new_tokens, seq.num_prompt_tokens) - item.start_pos)
            self.served[seq.tenant] += PROMPT_TOKEN_COST * prompt if seq.num_preemptions == 0 else 0
        for seq in sched.update_from_output(
            out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample}
        ):
            self.served[seq.tenant] += OUTPUT_TOKEN_COST
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH, "length")

    def backlogged(self, tenant: str) -> bool:
        return any(s.tenant == tenant for s in self.sched.waiting)


def _add(sched: Scheduler, tenant: str, count: int, *, prompt: int = 8, out: int = 8, **kw) -> list[Sequence]:
    seqs = []
    for i in range(count):
        # Prompts unique to the tenant: a prefix-cache hit would make its service cheaper.
        tokens = [100 + sum(map(ord, tenant)) % 300, *([1 + i % 50] * (prompt - 1))]
        seq = Sequence(f"{tenant}{i}-{time.monotonic_ns()}", tokens, Params(out), tenant=tenant, **kw)
        sched.add(seq)
        seqs.append(seq)
    return seqs


def test_a_heavy_tenant_gets_no_more_service_than_a_light_one_while_both_are_backlogged():
    sched = _scheduler(max_num_seqs=4)
    run = Run(sched)
    _add(sched, "heavy", 120)  # 4x the light tenant's backlog, same request shape
    _add(sched, "light", 30)
    steps = 0
    while run.backlogged("light"):
        run.step()
        steps += 1
    # The light tenant is served at the heavy one's rate: its whole backlog was admitted while the
    # heavy one had at most one request of advance per slot.
    light = sum(1 for s in run.admitted if s.tenant == "light")
    heavy = sum(1 for s in run.admitted if s.tenant == "heavy")
    assert light == 30 and heavy <= light + 4, (light, heavy)
    per_request = 8 * PROMPT_TOKEN_COST + 8 * OUTPUT_TOKEN_COST
    assert abs(run.served["heavy"] - run.served["light"]) <= 4 * per_request


def test_fcfs_serves_the_earlier_backlog_first():
    sched = _scheduler(max_num_seqs=4, policy="fcfs")
    run = Run(sched)
    _add(sched, "heavy", 40)
    _add(sched, "light", 10)
    while not any(s.tenant == "light" for s in run.admitted):
        run.step()
    assert sum(1 for s in run.admitted if s.tenant == "heavy") == 40


@pytest.mark.parametrize("weights", [(1, 3), (1, 2, 3, 4)])
def test_service_is_shared_in_proportion_to_the_weights(weights):
    sched = _scheduler(max_num_seqs=8, budget=128)
    run = Run(sched)
    tenants = [f"t{w}" for w in weights]
    for tenant, weight in zip(tenants, weights, strict=True):
        _add(sched, tenant, 400, weight=float(weight))
    for _ in range(250):
        run.step()
    assert all(run.backlogged(t) for t in tenants)  # shares only mean something under backlog
    total = sum(run.served[t] for t in tenants)
    for tenant, weight in zip(tenants, weights, strict=True):
        share, want = run.served[tenant] / total, weight / sum(weights)
        assert abs(share - want) <= 0.05, (tenant, share, want)


def test_a_tenant_returning_from_idle_banks_no_credit():
    sched = _scheduler(max_num_seqs=1)
    run = Run(sched)
    _add(sched, "a", 40)
    for _ in range(150):  # A alone builds a large counter
        run.step()
    _add(sched, "b", 40)
    first = len(run.admitted)
    while len(run.admitted) < first + 10:
        run.step()
    # Lifted to A's counter on arrival: B alternates with A instead of taking every slot.
    newly = [s.tenant for s in run.admitted[first:]]
    assert 4 <= newly.count("a") <= 6, newly


def test_counters_lift_to_the_least_active_and_remember_the_last_idle_one():
    counters = ServiceCounters()
    counters.activate("a", 1.0)
    counters.charge("a", prompt_tokens=100)
    counters.activate("b", 1.0)  # lifted to a's 100
    assert counters.service("b") == 100.0
    counters.charge("b", output_tokens=10)  # 2 per output token
    assert counters.service("b") == 120.0
    counters.deactivate("a")
    counters.deactivate("b")
    counters.activate("c", 2.0)  # nobody active: the virtual time is where the last one left
    assert counters.service("c") == 120.0
    counters.charge("c", prompt_tokens=10)
    assert counters.service("c") == 125.0  # weight 2: half the counter per token
    assert counters.snapshot()["c"]["served"] == 10.0


@settings(max_examples=60, deadline=None)
@given(
    heavy=st.integers(10, 40),
    light=st.integers(3, 10),
    slots=st.integers(1, 4),
    shape=st.tuples(st.integers(2, 24), st.integers(1, 12)),
)
def test_the_service_gap_stays_bounded_while_both_tenants_are_backlogged(heavy, light, slots, shape):
    prompt, out = shape
    sched = _scheduler(max_num_seqs=slots, budget=32)
    run = Run(sched)
    _add(sched, "heavy", heavy, prompt=prompt, out=out)
    _add(sched, "light", light, prompt=prompt, out=out)
    per_request = prompt * PROMPT_TOKEN_COST + out * OUTPUT_TOKEN_COST
    for _ in range(2000):
        if not (run.backlogged("light") and run.backlogged("heavy")):
            break
        run.step()
        # VTC's bound: the gap of two backlogged tenants stays within a request's cost per slot.
        assert abs(run.served["heavy"] - run.served["light"]) <= (slots + 1) * per_request


# -- priority tiers -----------------------------------------------------------------------------


def test_a_higher_tier_preempts_the_most_served_tenant_of_the_lowest_tier():
    sched = _scheduler(max_num_seqs=3)
    run = Run(sched)
    flex = _add(sched, "f", 1, priority=2)[0]
    busy = _add(sched, "d1", 1, priority=1, prompt=40)[0]
    quiet = _add(sched, "d2", 1, priority=1, prompt=8)[0]
    run.step()
    assert {s.status for s in (flex, busy, quiet)} == {SequenceStatus.RUNNING}
    urgent = _add(sched, "p", 2, priority=0)
    # One slot made per step for the head of the queue: the flex sequence goes first, then the
    # default tier's most-served tenant; each priority request runs in the step that made its room.
    out = sched.schedule()
    assert out.preempted == [flex] and urgent[0] in {s.seq for s in out.scheduled}
    sched.update_from_output(out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample})
    out = sched.schedule()
    assert out.preempted == [busy] and urgent[1] in {s.seq for s in out.scheduled}
    assert quiet.status is SequenceStatus.RUNNING


def test_flex_runs_only_on_spare_capacity():
    sched = _scheduler(max_num_seqs=2)
    run = Run(sched)
    flex = _add(sched, "f", 4, priority=2)
    default = _add(sched, "d", 2, priority=1)
    run.step()
    assert all(s.status is SequenceStatus.RUNNING for s in default)
    assert all(s.status is SequenceStatus.WAITING for s in flex)
    while not all(s.is_finished for s in default):
        run.step()
    run.step()
    assert sum(s.status is SequenceStatus.RUNNING for s in flex) == 2  # the slots were spare


# -- queue deadlines ----------------------------------------------------------------------------


def test_a_request_past_its_queue_deadline_is_dropped_before_any_compute():
    sched = _scheduler(max_num_seqs=1)
    running = _add(sched, "a", 1, out=50)[0]
    Run(sched).step()
    late = Sequence("late", [1, 2, 3], Params(4), tenant="b", deadline=time.time() - 1)
    sched.add(late)
    patient = Sequence("patient", [1, 2, 3], Params(4), tenant="b", deadline=time.time() + 3600)
    sched.add(patient)
    out = sched.schedule()
    assert out.finished_expired == [late]
    assert late.finish_reason == "queue_timeout" and late.num_computed_tokens == 0
    assert running.status is SequenceStatus.RUNNING and patient.status is SequenceStatus.WAITING
    assert sched.get_stats()["num_expired"] == 1


def test_a_started_request_is_never_dropped_for_its_deadline():
    sched = _scheduler(max_num_seqs=1)
    seq = Sequence("r", [1] * 8, Params(30), tenant="a", deadline=time.time() + 3600)
    sched.add(seq)
    run = Run(sched)
    run.step()
    seq.deadline = time.time() - 1  # passes while it runs
    run.step()
    assert seq.status is SequenceStatus.RUNNING


def test_the_engine_ends_an_expired_request_with_a_queue_timeout_error_billed_nothing(tiny_llama_dir: Path):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=1),
        )
    )
    engine.add_request("busy", [0, 1, 2], SamplingParams(max_tokens=20, ignore_eos=True), tenant="a")
    engine.step()
    engine.add_request("late", [0, 3, 4], SamplingParams(max_tokens=4), tenant="b", deadline=time.time() - 1)
    outputs = {o.request_id: o for o in engine.step()}
    late = outputs["late"]
    assert late.finished and late.error_code == "queue_timeout"
    held = HeldRequest(request_id="late", message_id=EntryRef("requests", b"1-0"), n=1, num_prompt_tokens=3)
    (event,) = events_for_output(held, late)
    assert event.type == "error" and event.code == "queue_timeout"
    assert event.usage == {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    assert engine.scheduler.num_running == 1  # busy, 2 of its 20 tokens made
    with pytest.raises(Exception, match="weight"):
        engine.add_request("w", [0, 1], SamplingParams(max_tokens=1), weight=0)
