"""Speculative decoding with a draft model (engine.draft_model): drafts decoded by a second model
of the same vocabulary, verified by the engine's one verification path (engine.speculative).
Whatever the draft model, the outputs are the target's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.make_model import make_model
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import _prompts
from tests.engine.test_speculative import _run_checked

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(model_dir: Path, speculative: SpeculativeConfig | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(num_blocks=128),
            scheduler=SchedulerConfig(max_num_seqs=8),
            speculative=speculative,
        )
    )


def _outputs(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out = _run_checked(engine)
    return [out[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shape and tokenizer with other random weights: a draft that mostly misses."""
    return make_model(tmp_path_factory.mktemp("tiny-llama-seed1"), arch="llama", size="tiny", seed=1)


def test_the_model_as_its_own_draft_has_every_draft_accepted(tiny_llama_dir: Path) -> None:
    prompts = _prompts([5, 17, 40, 9, 26], seed=21)
    want = _outputs(_engine(tiny_llama_dir, None), prompts)
    spec = SpeculativeConfig(num_speculative_tokens=4, draft_model=str(tiny_llama_dir), draft_num_blocks=64)
    fast = _engine(tiny_llama_dir, spec)
    assert _outputs(fast, prompts) == want
    stats = fast.get_stats()
    assert stats["spec_num_draft_tokens"] > 50
    assert stats["spec_acceptance_rate"] > 0.95  # its own greedy tokens, up to float ties
    assert stats["spec_mean_accepted_length"] > 4.5
    draft = fast.speculator.draft_model
    draft.release_finished()  # every sequence finished: the draft pool is empty again
    assert draft.num_shadows == 0 and draft.blocks.num_free_blocks == draft.blocks.num_total_blocks
    assert not draft.runner._generators  # no per-call state left behind


def test_a_draft_model_that_misses_leaves_the_outputs_unchanged(
    tiny_llama_dir: Path, other_llama_dir: Path
) -> None:
    """Most drafts rejected: the draft model's KV is rolled back to the accepted tokens each time,
    and the greedy outputs are the target's. (A sampled row's draft, like an n-gram draft, is one
    token per position, verified by the same rejection sampling, whose distribution
    test_speculative checks.)"""
    prompts = _prompts([5, 17, 40, 9, 26, 3], seed=22)
    spec = SpeculativeConfig(
        num_speculative_tokens=3, draft_model=str(other_llama_dir), draft_num_blocks=64, min_acceptance=0.0
    )
    want = _outputs(_engine(tiny_llama_dir, None), prompts)
    fast = _engine(tiny_llama_dir, spec)
    assert _outputs(fast, prompts) == want
    stats = fast.get_stats()
    assert stats["spec_num_drafts"] > 20
    assert stats["spec_num_draft_tokens"] > 2 * stats["spec_num_accepted_tokens"]
    fast.speculator.draft_model.blocks.check_invariants()
    # Sampled rows speculate through it too, and end at their lengths with the pools intact.
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)
    assert [len(t) for t in _outputs(fast, prompts, sampled)] == [24] * len(prompts)
    assert fast.get_stats()["spec_num_drafts"] > stats["spec_num_drafts"]


def test_a_small_draft_pool_makes_room_by_dropping_other_sequences_shadows(tiny_llama_dir: Path) -> None:
    """Eight sequences of up to 64 tokens in a draft pool of 12 blocks of 16: shadows are dropped and
    rebuilt as sequences take turns, and the outputs stay the target's."""
    prompts = _prompts([30, 35, 40, 20, 25, 33, 38, 28], seed=23)
    want = _outputs(_engine(tiny_llama_dir, None), prompts)
    spec = SpeculativeConfig(num_speculative_tokens=4, draft_model=str(tiny_llama_dir), draft_num_blocks=12)
    fast = _engine(tiny_llama_dir, spec)
    assert _outputs(fast, prompts) == want
    draft = fast.speculator.draft_model
    assert draft.num_shadows <= 12
    draft.blocks.check_invariants()
    assert fast.get_stats()["spec_num_accepted_tokens"] > 0


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_llama_dir, other)
    raw = json.loads((other / "config.json").read_text())
    raw["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="share the model's tokenizer"):
        _engine(tiny_llama_dir, SpeculativeConfig(draft_model=str(other)))
    with pytest.raises(ConfigError, match="draft model cannot be loaded"):
        _engine(tiny_llama_dir, SpeculativeConfig(draft_model=str(tmp_path / "missing")))
