from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.errors import RequestTooLargeError
from engine.lora.slots import LoRASlots
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

BS = 4


@dataclass
class Params:
    max_tokens: int = 16
    n: int = 1
    prompt_logprobs: int | None = None  # as SamplingParams: none asked for


def make_scheduler(
    num_blocks: int = 32,
    *,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    chunked: bool = True,
    prefix_caching: bool = True,
    prefill_cap: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            max_prefill_tokens_with_decodes=prefill_cap,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
        num_blocks,
    )


def make_seq(request_id: str, tokens: list[int], max_tokens: int = 16, **kw) -> Sequence:
    return Sequence(request_id, tokens, Params(max_tokens=max_tokens), **kw)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    sampled = {s.seq.seq_id: [token] for s in out.scheduled if s.needs_sample}
    return out, sched.update_from_output(out, sampled)


def chunks(out: SchedulerOutput) -> dict[str, int]:
    return {s.seq.request_id: s.num_new_tokens for s in out.scheduled}


def test_a_prompt_is_prefilled_then_decoded_one_token_per_step():
    sched = make_scheduler()
    seq = make_seq("r", [1, 2, 3, 4, 5])
    sched.add(seq)

    out, got = step(sched, token=9)
    assert chunks(out) == {"r": 5} and out.num_batched_tokens == 5
    assert got == [seq] and seq.output_token_ids == [9]
    assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 5

    out, got = step(sched, token=8)
    assert chunks(out) == {"r": 1} and out.scheduled[0].start_pos == 5
    assert seq.output_token_ids == [9, 8] and seq.num_computed_tokens == 6


def test_chunked_prefill_splits_a_long_prompt_while_a_running_decode_gets_its_token_every_step():
    sched = make_scheduler(budget=8)
    decode = make_seq("decode", [1, 2, 3])
    sched.add(decode)
    step(sched)
    long = make_seq("long", list(range(20)))
    sched.add(long)

    seen = []
    for _ in range(3):
        out, got = step(sched)
        assert out.num_batched_tokens <= 8
        assert decode in got
        seen.append(chunks(out))

    assert seen == [{"decode": 1, "long": 7}, {"decode": 1, "long": 7}, {"decode": 1, "long": 6}]
    assert long.num_output_tokens == 1 and long.num_computed_tokens == 20
    assert decode.num_output_tokens == 4


def test_while_sequences_decode_a_step_computes_at_most_the_prefill_cap_of_prompt_tokens():
    # given a cap of 5 prompt tokens while sequences decode, in a budget of 32
    sched = make_scheduler(budget=32, prefill_cap=5)
    first = make_seq("first", list(range(20)))
    sched.add(first)

    # when nothing decodes yet, a prompt takes the whole budget
    out, _ = step(sched)
    assert chunks(out) == {"first": 20}

    # then, with a decode running, two new prompts share 5 prompt tokens a step, in order, while
    # the decode gets its token every step
    second, third = make_seq("second", list(range(100, 107))), make_seq("third", list(range(200, 203)))
    sched.add(second)
    sched.add(third)
    seen = [chunks(step(sched)[0]) for _ in range(3)]
    assert seen == [
        {"first": 1, "second": 5},
        {"first": 1, "second": 2, "third": 3},
        {"first": 1, "second": 1, "third": 1},
    ]


def test_the_prefill_cap_leaves_prompts_unsplit_without_chunked_prefill():
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False, prefill_cap=2)
    sched.add(make_seq("a", [1] * 4))
    step(sched)
    sched.add(make_seq("b", [2] * 10))

    out, _ = step(sched)

    assert chunks(out) == {"a": 1, "b": 10}


def test_without_chunked_prefill_a_prompt_is_never_split():
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    first, second = make_seq("a", [1] * 10), make_seq("b", [2] * 10)
    sched.add(first)
    sched.add(second)

    out, _ = step(sched)

    assert chunks(out) == {"a": 10}  # b would only fit split, so it waits for the next step
    out, _ = step(sched)
    assert chunks(out) == {"a": 1, "b": 10}


def test_prefix_cache_hit_on_admission_skips_the_cached_tokens():
    sched = make_scheduler()
    first = make_seq("a", list(range(10)), cache_salt="t1")
    sched.add(first)
    step(sched)
    second = make_seq("b", list(range(10)) + [42], cache_salt="t1")
    sched.add(second)

    out, _ = step(sched)

    assert chunks(out) == {"a": 1, "b": 3}
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert sched.block_manager.prefix_cache_stats() == {"queries": 21, "hits": 8, "hit_rate": 8 / 21}


def test_another_tenant_salt_does_not_hit_the_cache():
    sched = make_scheduler()
    sched.add(make_seq("a", list(range(10)), cache_salt="t1"))
    step(sched)
    other = make_seq("b", list(range(10)), cache_salt="t2")
    sched.add(other)

    out, _ = step(sched)

    assert chunks(out)["b"] == 10 and other.num_cached_tokens == 0


def test_parallel_samples_wait_for_the_prompt_then_share_its_full_blocks():
    sched = make_scheduler()
    first = make_seq("r", list(range(10)), index=0)
    second = make_seq("r", list(range(10)), index=1)
    sched.add(first)
    sched.add(second)
    assert sched.num_waiting == 2

    out, _ = step(sched)
    assert [s.seq for s in out.scheduled] == [first]

    out, _ = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(first, 1), (second, 2)]
    shared = first.block_table[:2]
    assert second.block_table[:2] == shared and second.block_table[2] != first.block_table[2]
    assert [sched.block_manager.blocks[b].ref_count for b in shared] == [2, 2]
    assert second.num_cached_tokens == 8


def test_preemption_takes_the_least_important_newest_running_sequence_and_keeps_its_outputs():
    sched = make_scheduler(num_blocks=6)
    # a matters most although it arrived last; c is the newest of the two less important ones.
    a = make_seq("a", [1] * 8, max_tokens=8, priority=0, arrival_time=3.0)
    b = make_seq("b", [2] * 8, max_tokens=8, priority=1, arrival_time=1.0)
    c = make_seq("c", [3] * 8, max_tokens=8, priority=1, arrival_time=2.0)
    for seq in (b, c, a):
        sched.add(seq)
    step(sched)  # all three prefilled: six blocks, the whole pool
    assert sched.block_manager.num_free_blocks == 0

    out, _ = step(sched)
    assert out.preempted == [c]
    assert (c.status, c.num_computed_tokens, c.block_table, c.num_output_tokens) == (
        SequenceStatus.WAITING,
        0,
        [],
        1,
    )
    assert {s.seq.request_id for s in out.scheduled} == {"a", "b"}

    preempted = []
    while not preempted:
        out, _ = step(sched)
        preempted = out.preempted
    assert preempted == [b]
    assert sched.get_stats()["num_preemptions"] == 2

    # Once a finishes, b (the more important waiter) is recomputed with its outputs; its own
    # freed blocks still in the cache spare part of the work.
    sched.finish(a, SequenceStatus.FINISHED_LENGTH, "length")
    assert (b.num_tokens, b.num_output_tokens) == (13, 5)
    out = sched.schedule()
    assert [(s.seq, s.start_pos, s.num_new_tokens) for s in out.scheduled] == [(b, 8, 5)]
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert c.status is SequenceStatus.WAITING  # 9 tokens need 3 blocks, 2 are free


def test_waiting_requests_are_admitted_by_priority():
    sched = make_scheduler(max_num_seqs=1)
    low = make_seq("low", [1], priority=5)
    high = make_seq("high", [2], priority=0)
    sched.add(low)
    sched.add(high)

    out, _ = step(sched)

    assert chunks(out) == {"high": 1}


def test_a_tenant_backlog_delays_another_tenant_by_at_most_one_admission():
    sched = make_scheduler(max_num_seqs=2, num_blocks=200)
    for i in range(100):
        sched.add(make_seq(f"a{i}", [1, 2], tenant="A"))
    sched.add(make_seq("b0", [3, 4], tenant="B"))

    out, _ = step(sched)

    assert set(chunks(out)) == {"a0", "b0"}


def test_admission_is_round_robin_across_tenants():
    sched = make_scheduler(max_num_seqs=1, num_blocks=200)
    for tenant, count in (("A", 3), ("B", 2), ("C", 1)):
        for i in range(count):
            sched.add(make_seq(f"{tenant}{i}", [1], tenant=tenant))

    order = []
    while sched.has_unfinished():
        out, got = step(sched)
        order.append(out.scheduled[0].seq.request_id)
        sched.finish(got[0], SequenceStatus.FINISHED_STOPPED, "stop")

    assert order == ["A0", "B0", "C0", "A1", "B1", "A2"]


def test_a_request_larger_than_the_pool_or_the_model_is_refused_and_nothing_is_queued():
    sched = make_scheduler(num_blocks=4, max_model_len=32)  # the pool holds 16 tokens

    with pytest.raises(RequestTooLargeError, match="needs 5 KV cache blocks but the engine has 4"):
        sched.add(make_seq("big", [1] * 10, max_tokens=10))
    with pytest.raises(RequestTooLargeError, match="max_model_len=32"):
        sched.add(make_seq("long", [1] * 33, max_tokens=1))

    assert not sched.has_unfinished() and sched.num_waiting == 0
    sched.add(make_seq("fits", [1] * 10, max_tokens=6))
    assert sched.num_waiting == 1


def test_max_tokens_beyond_max_model_len_is_capped_when_sizing():
    sched = make_scheduler(num_blocks=4, max_model_len=16)

    sched.add(make_seq("r", [1] * 10, max_tokens=1000))

    assert sched.num_waiting == 1


def test_abort_frees_the_blocks_at_the_next_schedule():
    sched = make_scheduler(num_blocks=8)
    running = make_seq("r", [1] * 6)
    waiting = make_seq("w", [2] * 3, index=1)
    sched.add(make_seq("w", [2] * 3, index=0))
    sched.add(waiting)
    sched.add(running)
    step(sched)
    assert sched.block_manager.num_free_blocks < 8

    assert sched.abort("r") and sched.abort("w")
    assert not sched.abort("unknown")
    assert running.status is SequenceStatus.RUNNING  # until the next step

    out = sched.schedule()
    assert {s.request_id for s in out.finished_aborted} == {"r", "w"}
    assert len(out.finished_aborted) == 3 and out.scheduled == []
    assert all(
        s.status is SequenceStatus.FINISHED_ABORTED and s.finish_reason == "abort"
        for s in out.finished_aborted
    )
    assert sched.block_manager.num_free_blocks == 8
    assert not sched.has_unfinished() and sched.num_running == sched.num_waiting == 0


def test_finish_frees_the_blocks_and_stats_report_the_pool():
    sched = make_scheduler(num_blocks=8)
    seq = make_seq("r", [1] * 6)
    sched.add(seq)
    step(sched)
    assert sched.get_stats() == {
        "num_running": 1,
        "num_waiting": 0,
        "num_free_blocks": 6,
        "num_total_blocks": 8,
        "kv_cache_usage": 0.25,
        "prefix_cache_hit_rate": 0.0,
        "num_preemptions": 0,
        "num_expired": 0,
        "num_sat_out": 0,
    }

    sched.finish(seq, SequenceStatus.FINISHED_STOPPED, "stop")

    assert (seq.status, seq.finish_reason, seq.block_table) == (SequenceStatus.FINISHED_STOPPED, "stop", [])
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()


def test_slot_mapping_follows_the_block_table():
    sched = make_scheduler()
    seq = make_seq("r", [1] * 6)
    sched.add(seq)
    out = sched.schedule()

    t = seq.block_table
    assert sched.compute_slot_mapping(seq, 0, 6) == [
        t[0] * 4,
        t[0] * 4 + 1,
        t[0] * 4 + 2,
        t[0] * 4 + 3,
        t[1] * 4,
        t[1] * 4 + 1,
    ]
    assert out.scheduled[0].needs_sample


# -- properties ---------------------------------------------------------------------------------

STOP = 3


class Harness:
    """A stand-in engine around a real Scheduler: simulates the KV cache writes and reads of each
    step, checks every invariant after every operation, and applies the stop conditions."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.cfg = sched.config
        self.bm = sched.block_manager
        self.slots: dict[int, tuple] = {}
        self.seqs: list[Sequence] = []
        self.request_ids: list[str] = []

    @staticmethod
    def kv(seq: Sequence, pos: int) -> tuple:
        return (seq.lora_id, seq.cache_salt, tuple(seq.token_ids[: pos + 1]))

    def add(self, prompt: list[int], max_tokens: int, n: int, **kw) -> None:
        request_id = f"r{len(self.request_ids)}"
        waiting_before = self.sched.num_waiting
        try:
            for index in range(n):
                seq = make_seq(request_id, prompt, max_tokens, index=index, **kw)
                self.sched.add(seq)
                self.seqs.append(seq)
        except RequestTooLargeError:
            assert index == 0 and self.sched.num_waiting == waiting_before
            return
        self.request_ids.append(request_id)

    def step(self, tokens: list[int], abort_between: str | None = None) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_output(out)
        for item in out.scheduled:
            seq = item.seq
            # The context this step attends to must be exactly this sequence's own KV.
            mapping = self.sched.compute_slot_mapping(seq, 0, item.start_pos + item.num_new_tokens)
            for pos in range(item.start_pos):
                assert self.slots[mapping[pos]] == self.kv(seq, pos), (seq, pos)
            for pos in range(item.start_pos, item.start_pos + item.num_new_tokens):
                self.slots[mapping[pos]] = self.kv(seq, pos)
        if abort_between is not None:
            self.sched.abort(abort_between)
        needs = [s.seq for s in out.scheduled if s.needs_sample]
        sampled = {seq.seq_id: [tokens[i % len(tokens)]] for i, seq in enumerate(needs)}
        got = self.sched.update_from_output(out, sampled)
        assert got == needs
        for seq in got:
            if seq.last_token_id == STOP:
                self.sched.finish(seq, SequenceStatus.FINISHED_STOPPED, "stop")
            elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH, "length")
        self.check_state()
        return out

    def check_output(self, out: SchedulerOutput) -> None:
        scheduled = [s.seq for s in out.scheduled]
        assert len(set(map(id, scheduled))) == len(scheduled)
        assert len(scheduled) <= self.cfg.max_num_seqs
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.cfg.max_num_batched_tokens
        for item in out.scheduled:
            assert item.seq.status is SequenceStatus.RUNNING
            assert 1 <= item.num_new_tokens <= item.seq.num_tokens - item.start_pos
            assert len(item.seq.block_table) * BS >= item.start_pos + item.num_new_tokens
        for seq in out.preempted:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING)  # may be readmitted later
        # Something is always runnable: no deadlock while work remains.
        if self.sched.has_unfinished():
            assert out.scheduled

    def check_state(self) -> None:
        self.bm.check_invariants()
        running = self.sched.running
        assert len(running) <= self.cfg.max_num_seqs
        held = [b for seq in running for b in seq.block_table]
        for block in self.bm.blocks:
            assert block.ref_count == held.count(block.block_id)
        assert self.bm.num_free_blocks == self.bm.num_total_blocks - len(set(held))
        for seq in running:
            assert seq.status is SequenceStatus.RUNNING
            # Exactly the blocks its computed tokens need: nothing leaks between steps.
            assert len(seq.block_table) == self.bm.num_blocks_for(seq.num_computed_tokens)
        for seq in self.seqs:
            if seq.status is SequenceStatus.WAITING:
                assert seq.block_table == [] and seq.num_computed_tokens == 0
            if seq.is_finished:
                assert seq.block_table == [] and seq.finish_reason is not None
        unfinished = [s for s in self.seqs if not s.is_finished]
        assert self.sched.num_running + self.sched.num_waiting == len(unfinished)


# Prompts over a tiny vocabulary, often behind a shared prefix, so that cache hits are common.
prompts = st.one_of(
    st.lists(st.integers(0, 2), min_size=1, max_size=12),
    st.builds(
        lambda base, tail: base + tail,
        st.sampled_from([[1, 2, 1, 2, 1], [2, 2, 2, 2, 2, 2, 2, 2, 1]]),
        st.lists(st.integers(0, 2), max_size=6),
    ),
)

request = st.tuples(
    prompts,
    st.integers(1, 10),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 2),  # priority
    st.sampled_from(["A", "B", "C"]),
    st.sampled_from([(0, None), (0, None), (0, "A"), (1, None)]),  # (lora_id, cache_salt)
)
# Requests arrive in bursts so that the pool fills up and preemption happens.
add_op = st.tuples(st.just("add"), st.lists(request, min_size=1, max_size=4))
# Sampled tokens; STOP is rare so that sequences live long enough to fill the pool.
step_op = st.tuples(
    st.just("step"), st.lists(st.sampled_from([0, 1, 2, 1, 0, 2, STOP]), min_size=1, max_size=4)
)
# Adds and steps dominate so that pools fill up, prefixes get reused and preemption happens.
operations = st.lists(
    st.one_of(
        add_op,
        add_op,
        step_op,
        step_op,
        step_op,
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("abort_between"), st.integers(0, 30)),
        st.tuples(st.just("error"), st.integers(0, 60)),
    ),
    min_size=6,
    max_size=40,
)


@st.composite
def schedulers(draw) -> Scheduler:
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(8, 32))
    budget = draw(st.integers(2, 24))
    if not chunked:
        budget = max(budget, max_model_len)
    max_num_seqs = draw(st.integers(1, 6 if chunked else min(6, budget)))
    return make_scheduler(
        draw(st.integers(3, 12)),
        budget=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        chunked=chunked,
        prefix_caching=draw(st.sampled_from([True, True, False])),
    )


@settings(max_examples=200, deadline=None)
@given(sched=schedulers(), ops=operations)
def test_random_workloads_never_leak_or_overrun_and_always_run_to_completion(sched, ops):
    h = Harness(sched)
    for op in ops:
        kind = op[0]
        if kind == "add":
            for prompt, max_tokens, n, priority, tenant, (lora_id, salt) in op[1]:
                h.add(
                    prompt, max_tokens, n, priority=priority, tenant=tenant, lora_id=lora_id, cache_salt=salt
                )
            h.check_state()
        elif kind == "step":
            h.step(op[1])
        elif kind in ("abort", "abort_between") and h.request_ids:
            request_id = h.request_ids[op[1] % len(h.request_ids)]
            if kind == "abort":
                sched.abort(request_id)
            else:
                h.step([1, 2], abort_between=request_id)
        elif kind == "error" and h.seqs:
            seq = h.seqs[op[1] % len(h.seqs)]
            sched.finish(seq, SequenceStatus.FINISHED_ERROR, "error")
            h.check_state()

    for _ in range(2000):
        if not sched.has_unfinished():
            break
        h.step([1, 0, 2])
    assert not sched.has_unfinished()
    assert all(seq.is_finished for seq in h.seqs)
    assert sched.num_running == sched.num_waiting == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    assert all(block.ref_count == 0 for block in sched.block_manager.blocks)
    # Coverage of the interesting paths, visible with --hypothesis-show-statistics.
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hit: {sched.block_manager.prefix_cache_stats()['hits'] > 0}")
    event(f"aborted: {any(s.status is SequenceStatus.FINISHED_ABORTED for s in h.seqs)}")
    event(f"parallel sampling: {any(s.index > 0 for s in h.seqs)}")


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(6, 7),
    budget=st.integers(4, 8),
    tails=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), min_size=4, max_size=4),
    salt=st.sampled_from([None, "A"]),
    ns=st.lists(st.integers(1, 2), min_size=4, max_size=4),
    abort_at=st.integers(2, 8),
    victim=st.integers(0, 3),
    tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4),
)
def test_preemption_prefix_hits_and_an_abort_in_one_run_keep_every_block_and_kv_correct(
    num_blocks, budget, tails, salt, ns, abort_at, victim, tokens
):
    # Four requests share a two-block prefix and each grows to 24 tokens (six blocks), so the pool
    # cannot hold them: preemption, cache hits (on the shared prefix, and on a preempted sequence's
    # own blocks) and the abort of a live request happen in every example.
    sched = make_scheduler(num_blocks, budget=budget, max_num_seqs=4, max_model_len=24)
    h = Harness(sched)
    for i, tail in enumerate(tails):
        h.add([1, 2, 1, 2, 1, 2, 1, 2] + tail, 16, ns[i], tenant=f"t{i % 2}", cache_salt=salt)
    for step in range(400):
        if step == abort_at:
            sched.abort(h.request_ids[victim])
        if not sched.has_unfinished():
            break
        h.step(tokens)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == num_blocks
    assert all(block.ref_count == 0 for block in sched.block_manager.blocks)
    assert sched.num_preemptions > 0
    assert sched.block_manager.prefix_cache_stats()["hits"] > 0
    assert any(s.status is SequenceStatus.FINISHED_ABORTED for s in h.seqs)


def test_a_less_important_tiers_prompts_yield_to_a_more_important_tiers_and_are_capped_beside_it():
    """SchedulerConfig.lower_tier_prefill_tokens (64): a flex-tier batch line's prompt gets at most
    64 tokens a step while a default-tier stream decodes, none in a step that starts a default-tier
    prompt, and the whole budget when it runs alone."""
    sched = make_scheduler(num_blocks=400, budget=256, max_model_len=512)
    interactive = make_seq("i", [1] * 8, max_tokens=100, priority=1)
    sched.add(interactive)
    step(sched)
    line = make_seq("b", [2] * 300, max_tokens=4, priority=2)
    sched.add(line)
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "b": 64}
    sched.add(make_seq("i2", [3] * 40, max_tokens=100, priority=1))
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "i2": 40}  # the default tier's first token is not held up
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "i2": 1, "b": 64}

    alone = make_scheduler(num_blocks=400, budget=256, max_model_len=512)
    alone.add(make_seq("b", [2] * 300, max_tokens=4, priority=2))
    out, _ = step(alone)
    assert chunks(out) == {"b": 256}
    uncapped = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512, lower_tier_prefill_tokens=None
        ),
        CacheConfig(block_size=BS),
        400,
    )
    uncapped.add(make_seq("i", [1] * 8, max_tokens=100, priority=1))
    step(uncapped)
    uncapped.add(make_seq("b", [2] * 300, max_tokens=4, priority=2))
    out, _ = step(uncapped)
    assert chunks(out) == {"i": 1, "b": 255}


def test_flex_decodes_sit_out_the_steps_that_compute_a_more_important_prompt():
    """A default-tier prompt's prefill step carries no flex-tier decode rows (its time to first
    token), while the default tier's own decodes stay in it; the flex decodes run in every other
    step, and in a step where the waiting prompt cannot start after all."""
    sched = make_scheduler(num_blocks=400, budget=256, max_model_len=512)
    interactive = make_seq("i", [1] * 8, max_tokens=100, priority=1)
    line = make_seq("b", [2] * 20, max_tokens=100, priority=2)
    sched.add(interactive)
    sched.add(line)
    step(sched)
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "b": 1}
    sched.add(make_seq("i2", [3] * 100, max_tokens=100, priority=1))
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "i2": 100}  # the line's decode waits one step
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "i2": 1, "b": 1}
    # Chunked: the line sits out every step of the prompt, and no more.
    sched.add(make_seq("i3", [4] * 400, max_tokens=100, priority=1))
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "i2": 1, "i3": 254}
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "i2": 1, "i3": 146}
    out, _ = step(sched)
    assert chunks(out) == {"i": 1, "i2": 1, "i3": 1, "b": 1}
    assert line.num_output_tokens == 4 and line.status is SequenceStatus.RUNNING  # 1 prefill, 3 decodes

    # A default-tier prompt that cannot start (its adapter finds no free slot: the line holds the
    # only one) does not hold the line's decodes back.
    slotted = Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512),
        CacheConfig(block_size=BS),
        400,
        lora_slots=LoRASlots(1),
    )
    adapted_line = make_seq("b", [2] * 20, max_tokens=100, priority=2, lora_id=1)
    slotted.add(make_seq("i", [1] * 8, max_tokens=100, priority=1))
    slotted.add(adapted_line)
    step(slotted)
    slotted.add(make_seq("i2", [3] * 40, max_tokens=100, priority=1, lora_id=2))
    for _ in range(3):
        out, _ = step(slotted)
        assert chunks(out) == {"i": 1, "b": 1}
    assert adapted_line.num_output_tokens == 4
