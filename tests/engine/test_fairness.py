"""Admission across tenants and priorities: a tenant's backlog never holds another tenant back by more
than one admission round, and a more important request is admitted first. The weighted fair share
of service itself is tested in test_fair_share.py."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


@dataclass
class Params:
    max_tokens: int
    n: int = 1
    prompt_logprobs: int | None = None  # as SamplingParams: none asked for


def _engine(model_dir: Path, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs),
        )
    )


def _admission_order(engine: LLMEngine, until: str, seen: Collection[str] = ()) -> list[str]:
    """Request ids not in `seen`, in the order they produce their first token (their prompts fit
    one step, so that is the order of admission), stepping until `until` is among them."""
    order: list[str] = []
    for _ in range(200):
        order += [
            o.request_id for o in engine.step() if o.request_id not in order and o.request_id not in seen
        ]
        if until in order:
            return order
    raise AssertionError(f"{until} was never admitted")


def test_a_tenant_with_a_backlog_of_100_delays_another_tenants_request_by_one_admission_at_most(
    tiny_llama_dir: Path,
) -> None:
    engine = _engine(tiny_llama_dir, max_num_seqs=2)
    for i in range(100):
        engine.add_request(f"a{i}", [0, 10 + i, 20], SamplingParams(max_tokens=3), tenant="A")
    # The backlog is already running when B's single request arrives.
    first = _admission_order(engine, until="a1")
    assert first == ["a0", "a1"]
    engine.add_request("b0", [0, 5, 6], SamplingParams(max_tokens=3), tenant="B")
    later = _admission_order(engine, until="b0", seen=first)
    # B starts level with A's service (no banked credit, no debt): the first free slot is B's, made
    # by preempting one of A's two (fair share takes a slot back for a tenant holding none).
    assert later[0] == "b0"
    assert engine.scheduler.num_fair_preemptions == 1
    assert engine.scheduler.num_waiting == 100 - len(first) - len(later) + 1 + 1


def test_a_more_important_request_is_admitted_ahead_of_an_earlier_queue(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, max_num_seqs=1)
    for i in range(5):
        engine.add_request(f"low{i}", [0, 10 + i], SamplingParams(max_tokens=2), tenant="A", priority=1)
    engine.add_request("high", [0, 99], SamplingParams(max_tokens=2), tenant="B", priority=0)
    assert _admission_order(engine, until="low1") == ["high", "low0", "low1"]


# -- property: one admission round, whatever the backlogs ---------------------------------------


backlogs = st.dictionaries(st.sampled_from("ABCD"), st.integers(1, 25), min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(
    backlogs=backlogs,
    max_num_seqs=st.integers(1, 4),
    lifetimes=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    arrival_step=st.integers(0, 12),
)
def test_a_newcomer_waits_at_most_one_admission_per_tenant_already_waiting(
    backlogs, max_num_seqs, lifetimes, arrival_step
):
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs, max_model_len=64),
        CacheConfig(block_size=4),
        num_blocks=256,  # memory never binds: only admission order is under test
    )
    n = 0
    for tenant, count in backlogs.items():
        for _ in range(count):
            sched.add(
                Sequence(f"{tenant}{n}", [1, 2, 3], Params(lifetimes[n % len(lifetimes)]), tenant=tenant)
            )
            n += 1
    newcomer = Sequence("new", [4, 5], Params(2), tenant="Z")
    admitted: list[Sequence] = []
    waiting_tenants: set[str] = set()
    for step in range(500):
        if step == arrival_step:
            waiting_tenants = {s.tenant for s in sched.waiting}
            sched.add(newcomer)
            before = len(admitted)
        out = sched.schedule()
        admitted += [s.seq for s in out.scheduled if s.start_pos == 0 and s.seq not in admitted]
        sched.update_from_output(out, {s.seq.seq_id: [7] for s in out.scheduled if s.needs_sample})
        for seq in list(sched.running):
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH, "length")
        if step >= arrival_step and newcomer in admitted:
            break
    ahead = admitted.index(newcomer) - before
    assert ahead <= len(waiting_tenants)
