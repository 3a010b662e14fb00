"""Prompt logprobs (vLLM's prompt_logprobs) come out of the prefill's own forward passes and equal
log_softmax of a full transformers forward: however the prompt is chunked, batched with other
requests, or already in the prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import hf_model

ATOL = 1e-4


def _reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _assert_matches(model_dir: Path, prompt: list[int], got, k: int, atol: float = ATOL) -> None:
    reference = _reference(model_dir, prompt)
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        row, entry = reference[i - 1], got[i]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=atol)
        expected_rank = int((row > row[prompt[i]]).sum()) + 1
        assert abs(entry.rank - expected_rank) <= 1  # float near-ties may order either way
        expected_top = row.topk(k).indices.tolist() if k else []
        assert [t for t, _ in entry.top_logprobs] == expected_top
        for token, lp in entry.top_logprobs:
            assert lp == pytest.approx(row[token].item(), abs=atol)


def _prompt(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


@pytest.mark.parametrize("budget", [1024, 7])  # whole prompts, and prefill chunked into 7-token steps
def test_prompt_logprobs_equal_a_full_forward(tiny_llama_dir: Path, budget: int):
    llm = LLM(str(tiny_llama_dir), num_blocks=64, max_num_batched_tokens=budget, max_num_seqs=4)
    prompts = [
        _prompt(llm, "The quick brown fox jumps over the lazy dog, twice over."),
        _prompt(llm, "def f(x):\n    return x * 2"),
        _prompt(llm, "Hi"),
    ]
    params = [
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3),
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0),
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5),
    ]

    outputs = llm.generate(prompts, params)

    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        _assert_matches(tiny_llama_dir, prompt, out.prompt_logprobs, p.prompt_logprobs)


def test_a_prompt_in_the_prefix_cache_is_computed_again_for_its_logprobs(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_blocks=64, block_size=4)
    prompt = _prompt(llm, "one two three four five six seven eight nine ten eleven twelve")
    warm = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    cached = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]

    assert warm.prompt_logprobs is None and cached.prompt_logprobs is None
    assert cached.num_cached_tokens > 0  # the cache still serves requests that do not ask
    assert again.num_cached_tokens == 0
    _assert_matches(tiny_llama_dir, prompt, again.prompt_logprobs, 2)
    assert again.outputs[0].token_ids == warm.outputs[0].token_ids


def test_siblings_share_one_set_and_other_requests_are_unaffected(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), num_blocks=64)
    prompt = _prompt(llm, "A long time ago in a galaxy far, far away")
    plain = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]

    both = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=4, temperature=0, n=2, prompt_logprobs=1),
            SamplingParams(max_tokens=4, temperature=0),
        ],
    )

    _assert_matches(tiny_llama_dir, prompt, both[0].prompt_logprobs, 1)
    assert both[1].prompt_logprobs is None
    assert [o.token_ids for o in both[0].outputs] == [plain.outputs[0].token_ids] * 2
    assert both[1].outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_are_bounded_like_logprobs():
    from engine.sampling_params import SamplingParamsError

    for bad in (-1, 21, 2.5, True):
        with pytest.raises(SamplingParamsError):
            SamplingParams(prompt_logprobs=bad)


@pytest.mark.real_model
def test_real_model_prompt_logprobs_equal_transformers(smollm2_dir: Path):
    llm = LLM(str(smollm2_dir), num_blocks=128, max_num_batched_tokens=16)
    prompt = llm.tokenizer.encode("Question: What is the capital of France?\nAnswer: Paris")

    [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))

    _assert_matches(smollm2_dir, prompt, out.prompt_logprobs, 5, atol=1e-3)
