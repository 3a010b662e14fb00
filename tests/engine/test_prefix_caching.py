"""Prefix caching through the engine: tenants isolated by their cache salt, cached tokens reported,
and the n samples of one request sharing its prompt's blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import _prompts

PROMPT = _prompts([40], seed=11)[0]  # two full 16-token blocks and 8 tokens more


@pytest.fixture
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_blocks=24)))


def _run(engine: LLMEngine, request_id: str, prompt: list[int], **kwargs) -> tuple[int, list[int]]:
    """(cached prompt tokens, output ids) of one request run to completion."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request(request_id, prompt, params, **kwargs)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.request_id == request_id
    return final.num_cached_tokens, final.outputs[0].token_ids


def test_a_tenants_cache_salt_keeps_its_prefixes_from_other_tenants(engine: LLMEngine) -> None:
    cached, first = _run(engine, "a1", PROMPT, tenant="A", cache_salt="A")
    assert cached == 0
    # Tenant B sends the same prompt: nothing of A's is reused, although all of it is still cached.
    assert _run(engine, "b1", PROMPT, tenant="B", cache_salt="B") == (0, first)
    # The shared scope (no salt) is a third namespace.
    assert _run(engine, "s1", PROMPT, tenant="C", cache_salt=None) == (0, first)
    # Each tenant then hits its own blocks, and only whole blocks before the last prompt token.
    assert _run(engine, "a2", PROMPT, tenant="A", cache_salt="A") == (32, first)
    assert _run(engine, "b2", PROMPT, tenant="B", cache_salt="B") == (32, first)
    assert _run(engine, "s2", PROMPT, tenant="D", cache_salt=None) == (32, first)
    stats = engine.scheduler.block_manager.prefix_cache_stats()
    assert (stats["queries"], stats["hits"]) == (6 * 40, 3 * 32)
    assert engine.get_stats()["prefix_cache_hit_rate"] == pytest.approx(96 / 240)


def test_a_longer_prompt_with_the_same_start_reports_the_cached_part(engine: LLMEngine) -> None:
    _run(engine, "first", PROMPT[:20], cache_salt="A")  # one full block cached
    cached, _ = _run(engine, "longer", PROMPT, cache_salt="A")
    assert cached == 16


def test_parallel_samples_share_the_prompt_blocks_and_each_decode_in_their_own(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    engine.add_request(
        "n3", PROMPT, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    )
    engine.step()  # the first sample computes the prompt; its siblings wait for its blocks
    engine.step()
    seqs = sorted(engine.scheduler.running, key=lambda s: s.index)
    assert [s.index for s in seqs] == [0, 1, 2]
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert [bm.blocks[b].ref_count for b in shared] == [3, 3]
    # Past the shared blocks each sample has a block of its own: 2 shared + 3 tails, not 9.
    tails = {s.block_table[2] for s in seqs}
    assert len(tails) == 3 and bm.num_total_blocks - bm.num_free_blocks == 5
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.finished and len(final.outputs) == 3
    assert final.num_cached_tokens == 0  # the first sample computed the prompt itself
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_fully_cached_block_aligned_prompt_still_computes_its_last_block(engine: LLMEngine) -> None:
    aligned = PROMPT[:32]  # exactly two blocks, both cached after the first run
    cached, first = _run(engine, "once", aligned)
    assert cached == 0
    # The last prompt token must go through the model to give logits to sample from, so the
    # block holding it is computed again rather than taken from the cache.
    assert _run(engine, "twice", aligned) == (16, first)
