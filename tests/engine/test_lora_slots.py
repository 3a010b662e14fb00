"""Adapter slots and the scheduler: never more adapters in a step than slots, and nobody starves."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.lora.slots import LoRASlots
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


@dataclass
class Params:
    max_tokens: int = 4
    n: int = 1
    prompt_logprobs: int | None = None  # as SamplingParams: none asked for


def make_scheduler(
    max_loras: int, *, num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=64),
        CacheConfig(block_size=4),
        num_blocks,
        LoRASlots(max_loras),
    )


def run_step(sched: Scheduler) -> set[int]:
    """One step with token 7 sampled; returns the adapters the step ran."""
    out = sched.schedule()
    loras = {item.seq.lora_id for item in out.scheduled if item.seq.lora_id}
    for seq in sched.running:
        if seq.lora_id:
            assert sched.lora_slots.slot_of(seq.lora_id) is not None, "a running adapter lost its slot"
    sampled = {item.seq.seq_id: [7] for item in out.scheduled if item.needs_sample}
    for seq in sched.update_from_output(out, sampled):
        if seq.num_output_tokens >= seq.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH, "length")
    return loras


def test_an_empty_slot_is_taken_before_an_idle_adapter_is_evicted():
    slots = LoRASlots(2)

    assert slots.acquire(11, set()) == 0
    assert slots.acquire(12, {11}) == 1
    assert slots.slots == [11, 12] and slots.num_evictions == 0


def test_the_least_recently_used_idle_adapter_is_evicted_and_a_used_one_never():
    slots = LoRASlots(2)
    slots.acquire(11, set())
    slots.acquire(12, set())
    slots.touch(0)  # 11 used more recently than 12

    assert slots.acquire(13, set()) == 1  # 12 was the least recently used
    assert not slots.can_admit(14, {11, 13})  # both slots have running sequences
    assert slots.acquire(14, {13}) == 0  # 11 is idle, 13 is not
    assert slots.slots == [14, 13] and (slots.num_loads, slots.num_evictions) == (4, 2)


def test_the_base_model_and_resident_adapters_are_always_admissible():
    slots = LoRASlots(1)
    slots.acquire(11, set())

    assert slots.can_admit(0, {11}) and slots.can_admit(11, {11}) and not slots.can_admit(12, {11})


def test_three_adapters_through_two_slots_all_finish_and_the_third_waits_for_a_slot():
    sched = make_scheduler(2)
    seqs = [
        Sequence(f"r{i}", [1, 2, 3, 4, 5], Params(max_tokens=3), lora_id=lora)
        for i, lora in enumerate([1, 2, 3, 1])
    ]
    for seq in seqs:
        sched.add(seq)

    first = run_step(sched)

    assert first == {1, 2} and seqs[2].status is SequenceStatus.WAITING
    assert seqs[3].status is SequenceStatus.WAITING  # behind the head, which waits for a slot
    steps = [first]
    while sched.has_unfinished():
        steps.append(run_step(sched))
        assert len(steps) < 50
    assert 3 in set().union(*steps) and all(len(s) <= 2 for s in steps)
    assert all(seq.finish_reason == "length" for seq in seqs)
    assert sched.lora_slots.num_evictions >= 1


def test_base_model_requests_pass_a_head_waiting_for_a_slot_and_the_head_still_runs_next():
    sched = make_scheduler(1)
    running = Sequence("x", [1, 2, 3, 4, 5], Params(max_tokens=6), lora_id=1)
    sched.add(running)
    run_step(sched)
    head = Sequence("y", [1, 2, 3, 4, 5], Params(max_tokens=2), lora_id=2)
    other_adapter = Sequence("z", [1, 2, 3, 4, 5], Params(max_tokens=2), lora_id=3)
    base = Sequence("b", [1, 2, 3, 4, 5], Params(max_tokens=2))
    for seq in (head, other_adapter, base):
        sched.add(seq)

    assert run_step(sched) == {1}

    # The base-model request runs beside adapter 1; adapters 2 and 3 wait for the one slot.
    assert base.status is SequenceStatus.RUNNING
    assert head.status is SequenceStatus.WAITING and other_adapter.status is SequenceStatus.WAITING
    order = []
    while sched.has_unfinished():
        before = {s.request_id for s in sched.running}
        run_step(sched)
        order.extend(
            r for r in ("y", "z") if r not in before and any(s.request_id == r for s in sched.running)
        )
        assert len(order) < 50
    assert order[:1] == ["y"]  # the head got the freed slot first
    assert all(s.finish_reason == "length" for s in (running, head, other_adapter, base))


request = st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(0, 4))  # prompt len, max_tokens, lora


@settings(max_examples=100, deadline=None)
@given(
    max_loras=st.integers(1, 3),
    budget=st.integers(4, 32),
    max_num_seqs=st.integers(1, 6),
    num_blocks=st.integers(6, 24),
    bursts=st.lists(st.lists(request, min_size=1, max_size=5), min_size=1, max_size=6),
)
def test_random_adapter_mixes_never_exceed_the_slots_and_always_finish(
    max_loras, budget, max_num_seqs, num_blocks, bursts
):
    sched = make_scheduler(max_loras, num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs)
    seqs: list[Sequence] = []
    for burst in bursts:
        for length, max_tokens, lora in burst:
            seq = Sequence(
                f"r{len(seqs)}", list(range(1, length + 1)), Params(max_tokens=max_tokens), lora_id=lora
            )
            sched.add(seq)
            seqs.append(seq)
        assert len(run_step(sched)) <= max_loras
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        assert len(run_step(sched)) <= max_loras
    assert all(seq.finish_reason == "length" for seq in seqs)
    assert sched.block_manager.num_free_blocks == num_blocks
