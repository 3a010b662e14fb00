"""Sequence slots across tenants: one request may run at most max_seqs_per_request sequences (below
max_num_seqs), and fair share takes running slots back from the most-served tenant for a tenant
that waits, throwing away no more computed work than fair_preempt_tokens_per_step allows."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine import rules
from engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from engine.errors import RequestTooLargeError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from tests.engine.test_scheduler import Harness


@dataclass
class Params:
    max_tokens: int
    n: int = 1
    prompt_logprobs: int | None = None  # as SamplingParams: none asked for


def _scheduler(*, max_num_seqs: int = 8, budget: int = 64, num_blocks: int = 1024, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=256, **kw),
        CacheConfig(block_size=4),
        num_blocks=num_blocks,
    )


def _request(
    sched: Scheduler, tenant: str, n: int, *, prompt: int = 8, max_tokens: int = 1000
) -> list[Sequence]:
    request_id = f"{tenant}-{time.monotonic_ns()}"
    tokens = [100 + sum(map(ord, tenant)) % 300, *range(1, prompt)]
    seqs = [Sequence(request_id, tokens, Params(max_tokens, n=n), tenant=tenant, index=i) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    return seqs


def _step(sched: Scheduler):
    out = sched.schedule()
    for seq in sched.update_from_output(out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample}):
        if seq.num_output_tokens >= seq.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH, "length")
    return out


# -- the cap on a request's sequences -------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_num_seqs", "cap"), [(128, 32), (64, 16), (12, 3), (4, 2), (3, 2), (2, 1), (1, 1)]
)
def test_a_request_may_run_a_quarter_of_the_slots_by_default_and_the_web_tier_computes_the_same(
    max_num_seqs, cap
):
    assert SchedulerConfig(max_num_seqs=max_num_seqs).max_seqs_per_request == cap
    assert rules.max_seqs_per_request({"max_num_seqs": max_num_seqs}) == cap
    assert rules.max_seqs_per_request({}) == SchedulerConfig().max_seqs_per_request == 32


def test_a_cap_of_every_slot_is_refused_and_an_explicit_one_is_shared_with_the_web_tier():
    with pytest.raises(ConfigError, match="max_seqs_per_request"):
        SchedulerConfig(max_num_seqs=16, max_seqs_per_request=16)
    with pytest.raises(ConfigError, match="fair_preempt_tokens_per_step"):
        SchedulerConfig(fair_preempt_tokens_per_step=-1)
    assert SchedulerConfig(max_num_seqs=16, max_seqs_per_request=10).max_seqs_per_request == 10
    assert rules.max_seqs_per_request({"max_num_seqs": 16, "max_seqs_per_request": 10}) == 10


def test_the_scheduler_refuses_a_request_over_the_cap_and_queues_nothing():
    sched = _scheduler(max_num_seqs=8)  # a cap of 2
    with pytest.raises(RequestTooLargeError, match=r"n=3.*max_seqs_per_request"):
        _request(sched, "a", 3)
    assert sched.num_waiting == 0 and not sched.has_unfinished()
    _request(sched, "a", 2)
    assert sched.num_waiting == 2


def test_the_engine_refuses_n_over_the_cap_before_anything_is_queued(tiny_llama_dir: Path):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=128),
        )
    )
    with pytest.raises(RequestTooLargeError, match=r"n=33.*at most 32"):
        engine.add_request("wide", [0, 1, 2], SamplingParams(n=33, max_tokens=2))
    # A grammar still compiling would have kept the request outside the scheduler: refused as early.
    with pytest.raises(RequestTooLargeError, match="n=128"):
        engine.add_request(
            "wide-json",
            [0, 1, 2],
            SamplingParams(n=128, max_tokens=2, structured_outputs={"json_object": True}),
        )
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert not engine.grammars.waiting
    engine.add_request("ok", [0, 1, 2], SamplingParams(n=32, max_tokens=2))
    assert engine.scheduler.num_waiting == 32


# -- fair share takes slots back ------------------------------------------------------------------


def test_a_tenant_waiting_behind_one_that_fills_every_slot_gets_one_within_a_few_steps():
    sched = _scheduler(max_num_seqs=8)  # cap 2; 16 tokens of preemption a step
    heavy = [s for _ in range(4) for s in _request(sched, "heavy", 2)]
    for _ in range(3):
        _step(sched)
    assert sched.num_running == 8 and all(s.status is SequenceStatus.RUNNING for s in heavy)
    (victim,) = _request(sched, "light", 1, max_tokens=4)
    # Light starts level with heavy's counter (no banked credit); heavy's next tokens put it ahead.
    out = _step(sched)
    assert victim.status is SequenceStatus.WAITING and not out.preempted
    out = _step(sched)
    assert victim in {s.seq for s in out.scheduled}
    (taken,) = out.preempted
    assert taken.tenant == "heavy" and taken.status is SequenceStatus.WAITING
    # Its KV (all its tokens but the last sampled) is what was thrown away; the bucket paid for it.
    assert sched.num_fair_preempted_tokens == taken.num_tokens - 1


def test_the_slot_is_taken_from_the_most_served_tenant_and_shares_converge_to_equal_slots():
    sched = _scheduler(max_num_seqs=8)
    heavy = [s for _ in range(3) for s in _request(sched, "heavy", 2)]
    for _ in range(20):
        _step(sched)
    modest = _request(sched, "modest", 2)  # arrives later: served less than heavy
    for _ in range(3):
        _step(sched)
    assert {s.status for s in heavy + modest} == {SequenceStatus.RUNNING}
    for _ in range(3):
        _request(sched, "light", 2)
    for _ in range(40):
        out = _step(sched)
        assert all(s.tenant == "heavy" for s in out.preempted)
    running = [s.tenant for s in sched.running]
    # light now holds as many slots as heavy; modest, served less than light, kept both of its own.
    assert running.count("modest") == 2
    assert running.count("light") == running.count("heavy") == 3
    assert sched.num_fair_preemptions == 3


def test_preemption_waits_for_the_bucket_to_pay_for_a_long_sequence():
    sched = _scheduler(max_num_seqs=2, fair_preempt_tokens_per_step=4)
    _request(sched, "heavy", 1, prompt=40)
    _request(sched, "heavy", 1, prompt=40)
    _step(sched)
    (victim,) = _request(sched, "light", 1)
    steps = 0
    while victim.status is SequenceStatus.WAITING:
        _step(sched)
        steps += 1
    # The newest heavy sequence holds 40 prompt tokens plus its outputs: at 4 a step, the bucket
    # (which filled 4 in the first step) pays for it after ~11 steps, never before.
    assert sched.num_fair_preemptions == 1
    assert 10 <= steps <= 12
    assert sched.num_fair_preempted_tokens <= 4 * (steps + 1)


def test_no_fair_preemption_when_it_is_turned_off():
    sched = _scheduler(max_num_seqs=2, fair_preempt_tokens_per_step=0)
    _request(sched, "heavy", 1, max_tokens=30)
    _request(sched, "heavy", 1, max_tokens=30)
    _step(sched)
    (victim,) = _request(sched, "light", 1)
    for _ in range(29):
        _step(sched)
        assert victim.status is SequenceStatus.WAITING
    assert sched.num_fair_preemptions == 0


# -- the bound on work thrown away ---------------------------------------------------------------


def test_time_slicing_one_slot_throws_away_no_more_than_the_bucket_pays_for():
    # One slot, two tenants with long requests: fair share alternates them by preemption, and each
    # swap throws away the preempted sequence's KV, which the bucket must have paid for.
    rate, max_model_len = 6, 256
    sched = _scheduler(max_num_seqs=1, fair_preempt_tokens_per_step=rate)
    _request(sched, "a", 1, prompt=20, max_tokens=200)
    _request(sched, "b", 1, prompt=20, max_tokens=200)
    for steps in range(1, 301):
        _step(sched)
        assert sched.num_fair_preempted_tokens <= steps * rate + max_model_len
    # It did alternate (many times), and spent most of what the bucket allowed.
    assert sched.num_fair_preemptions >= 10
    assert sched.num_fair_preempted_tokens >= 300 * rate // 2


# -- property: bounded work thrown away, no leaks ------------------------------------------------

request = st.tuples(
    st.sampled_from(["A", "B", "C"]),
    st.lists(st.integers(0, 2), min_size=1, max_size=12),  # prompt
    st.integers(4, 30),  # max_tokens: long enough to hold slots
    st.integers(1, 3),  # n (clipped to the cap)
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(request, min_size=1, max_size=3)),
        st.tuples(st.just("step"), st.lists(st.sampled_from([0, 1, 2, 1, 0, 2]), min_size=1, max_size=4)),
        st.tuples(st.just("step"), st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=4)),
    ),
    min_size=4,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(
    max_num_seqs=st.integers(1, 6),
    rate=st.integers(1, 8),
    budget=st.integers(4, 32),
    weights=st.tuples(st.sampled_from([1.0, 2.0]), st.sampled_from([1.0, 3.0])),
    ops=operations,
)
def test_fair_preemption_throws_away_at_most_its_bucket_and_leaks_nothing(
    max_num_seqs, rate, budget, weights, ops
):
    max_model_len = 48
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        fair_preempt_tokens_per_step=rate,
    )
    # Blocks for every sequence at full length: every preemption is fair share's (one tier too).
    sched = Scheduler(cfg, CacheConfig(block_size=4), num_blocks=40 * 12 + 8)
    h = Harness(sched)
    weight = {"A": weights[0], "B": weights[1], "C": 1.0}
    thrown, steps = 0, 0

    def step(tokens: list[int]) -> None:
        nonlocal thrown, steps
        computed = {s.seq_id: s.num_computed_tokens for s in sched.running}
        out = h.step(tokens)
        steps += 1
        assert len(out.preempted) <= 1
        thrown += sum(computed[seq.seq_id] for seq in out.preempted)
        assert thrown == sched.num_fair_preempted_tokens
        assert thrown <= steps * rate + max(max_model_len, rate)

    for op in ops:
        if op[0] == "add":
            for tenant, prompt, max_tokens, n in op[1]:
                n = min(n, cfg.max_seqs_per_request)
                h.add(prompt, max_tokens, n, tenant=tenant, weight=weight[tenant])
        else:
            step(op[1])
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        step([1, 0, 2])
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    assert all(block.ref_count == 0 for block in sched.block_manager.blocks)
    event(f"fair preemptions: {min(sched.num_fair_preemptions, 3)}")  # --hypothesis-show-statistics
