"""The engine's per-step profile: where each step's time went, phase by phase."""

from __future__ import annotations

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.step_profile import PHASES, StepProfile


def test_a_profiled_run_accounts_every_step_and_token_to_its_phases(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_batched_tokens=64, num_blocks=64)
    profile = llm.engine.profile = StepProfile()
    prompts = [[7 + i for i in range(40)], [9, 10, 11]]

    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))

    figures = profile.as_dict()
    assert profile.num_steps == llm.engine.num_steps
    # 43 prompt tokens (the 40-token prompt chunked over the 64-token budget) and 2 x 4 decodes
    assert profile.num_tokens == 43 + 2 * 4
    assert all(profile.seconds[p] > 0 for p in PHASES)
    assert abs(sum(profile.seconds.values()) - figures["total_s"]) < 1e-3
    assert set(figures["ms_per_step"]) == set(PHASES)
    assert "forward" in profile.table()


def test_an_engine_without_a_profile_reads_no_clock(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), device="cpu", num_blocks=64)
    calls = []
    monkeypatch.setattr(StepProfile, "mark", lambda self, phase: calls.append(phase))

    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))

    assert calls == []
