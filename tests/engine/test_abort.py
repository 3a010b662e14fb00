"""Abort of a request at any point of its life frees its blocks at the next step and leaves the
other requests exactly as they would have been."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from tests.engine.test_parity import _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BYSTANDER = _prompts([21], seed=12)[0]


@pytest.fixture(scope="module")
def bystander_alone(tiny_llama_dir: Path) -> list[int]:
    engine = _engine(tiny_llama_dir, num_blocks=32)
    engine.add_request("b", BYSTANDER, GREEDY)
    return _drain(engine)["b"].outputs[0].token_ids


def _engine(model_dir: Path, num_blocks: int) -> LLMEngine:
    # A 16-token budget chunks prompts, so a request can be caught half-way through its prefill.
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
        )
    )


def _drain(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals, "a request was reported finished twice"
            if out.finished:
                finals[out.request_id] = out
    return finals


def _victim(engine: LLMEngine):
    return [s for s in [*engine.scheduler.running, *engine.scheduler.waiting] if s.request_id == "victim"]


# Each moment: steps to run after the victim is queued, and what must be true of it then.
MOMENTS: dict[str, tuple[int, Callable[[LLMEngine], bool]]] = {
    "still waiting": (0, lambda e: all(s.status is SequenceStatus.WAITING for s in _victim(e))),
    "half-way through its prefill": (
        1,
        lambda e: any(0 < s.num_computed_tokens < s.num_prompt_tokens for s in _victim(e)),
    ),
    "decoding": (5, lambda e: any(s.num_output_tokens > 0 for s in _victim(e))),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_abort_at_any_moment_frees_every_block_at_the_next_step(
    moment: str, tiny_llama_dir: Path, bystander_alone: list[int]
) -> None:
    engine = _engine(tiny_llama_dir, num_blocks=32)
    engine.add_request("b", BYSTANDER, GREEDY)
    engine.step()
    engine.add_request(
        "victim", _prompts([40], seed=13)[0], SamplingParams(n=2, max_tokens=50, ignore_eos=True)
    )
    steps, holds = MOMENTS[moment]
    for _ in range(steps):
        engine.step()
    assert holds(engine), moment

    engine.abort_request("victim")
    outs = {o.request_id: o for o in engine.step()}
    victim = outs["victim"]
    assert victim.finished and [c.finish_reason for c in victim.outputs] == ["abort", "abort"]
    assert _victim(engine) == [] and engine.scheduler.num_waiting == 0
    held = {b for s in engine.scheduler.running for b in s.block_table}
    assert engine.scheduler.block_manager.num_free_blocks == 32 - len(held)
    assert all(s.request_id == "b" for s in engine.scheduler.running)

    finals = _drain(engine)
    assert "victim" not in finals and finals["b"].outputs[0].token_ids == bystander_alone
    assert engine.scheduler.block_manager.num_free_blocks == 32


def test_abort_of_a_preempted_request_frees_what_its_recompute_had_claimed(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = _engine(tiny_llama_dir, num_blocks=5)
    alone.add_request("b", BYSTANDER, params)
    expected = _drain(alone)["b"].outputs[0].token_ids
    # Five blocks: the bystander holds two, the victim's 45-token prompt three, so the victim (the
    # newer) is preempted as soon as it needs a fourth.
    engine = _engine(tiny_llama_dir, num_blocks=5)
    engine.add_request("b", BYSTANDER, params)
    engine.add_request("victim", _prompts([45], seed=14)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(20):
        engine.step()
        if engine.scheduler.num_preemptions:
            break
    (victim,) = _victim(engine)
    assert victim.num_preemptions == 1 and victim.num_output_tokens > 0
    assert victim.status is SequenceStatus.WAITING and victim.block_table == []

    engine.abort_request("victim")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["victim"].outputs[0].finish_reason == "abort"
    finals = _drain(engine)
    assert finals["b"].outputs[0].token_ids == expected
    assert engine.scheduler.block_manager.num_free_blocks == 5
    assert all(b.ref_count == 0 for b in engine.scheduler.block_manager.blocks)


def test_abort_of_an_unknown_or_finished_request_changes_nothing(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, num_blocks=8)
    engine.add_request("done", BYSTANDER, SamplingParams(max_tokens=2))
    _drain(engine)
    engine.abort_request("done")
    engine.abort_request("never-sent")
    assert engine.step() == [] and not engine.has_unfinished_requests()
