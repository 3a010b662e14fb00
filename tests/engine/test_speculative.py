"""Speculative decoding by n-gram prompt lookup (engine.speculative): the proposer, exact greedy
outputs on a real model, an unchanged sampling distribution, and the rollback of rejected drafts."""

from __future__ import annotations

import json
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import chi2_contingency

from engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.protocol import LoRARef
from engine.sampling_params import SamplingParams
from engine.speculative import accepted_tokens, propose_ngram
from tests.engine.lora_helpers import make_peft_adapter


def _propose(tokens: list[int], k: int = 3, min_n: int = 1, max_n: int = 3) -> list[int]:
    return propose_ngram(array("i", tokens), k, min_n, max_n)


def test_the_proposal_follows_the_latest_occurrence_of_the_longest_suffix() -> None:
    # Suffix [7, 8] occurred twice; the latest occurrence is followed by 5 6; the one-token
    # suffix [8] alone would also match after 9, but the longer match wins.
    assert _propose([7, 8, 1, 2, 7, 8, 5, 6, 8, 9, 7, 8]) == [5, 6, 8]
    assert _propose([7, 8, 1, 2, 7, 8, 5, 6, 8, 9, 7, 8], k=1) == [5]
    assert _propose([1, 2, 3, 4]) == []  # nothing repeats
    assert _propose([1, 2, 1], min_n=2) == []  # only a 1-gram repeats
    assert _propose([4, 5, 4, 5], k=8) == [4, 5]  # what follows, up to the end


def test_a_byte_match_across_token_boundaries_is_not_a_token_match() -> None:
    # Little-endian, 0x03000000 then 0 are the bytes 00 00 00 03 00 00 00 00, which hold those of
    # 0x00030000 (00 00 03 00) one byte in: not a token match.
    x = 0x00030000
    assert _propose([0x03000000, 0, 7, x], min_n=1, max_n=1) == []
    # The latest aligned occurrence is found past the unaligned one.
    assert _propose([x, 5, 0x03000000, 0, 7, x], min_n=1, max_n=1) == [5, 0x03000000, 0]


def test_a_verification_keeps_the_matching_prefix_and_the_sample_after_it() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted: a bonus token
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first differing sample
    assert accepted_tokens([5], [4, 1]) == [4]


# -- greedy: the same tokens as without speculation, on a real model ----------------------------

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass lantern"
    " and a notebook in which he recorded the wind, the tide and the ships that passed the point."
)
CODE = "def total(values):\n    result = 0\n    for value in values:\n        result = result + value\n    return result\n"


def _smollm2_engine(model_dir: Path, speculative: SpeculativeConfig | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=1024,
            cache=CacheConfig(num_blocks=256),
            scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=16),
            lora=LoRAConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=8),
            speculative=speculative,
        )
    )


def _chat(engine: LLMEngine, text: str) -> list[int]:
    return list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _run_checked(engine: LLMEngine, logprobs: dict[str, list] | None = None) -> dict[str, RequestOutput]:
    """Every request to completion, the block pool checked after every step; the logprobs of
    each request's first output gathered into `logprobs`."""
    bm = engine.scheduler.block_manager
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.outputs[0].logprobs_delta or [])
            if out.finished:
                final[out.request_id] = out
        bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked
    return final


@pytest.fixture(scope="module")
def smollm2_adapter(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(
        smollm2_dir, tmp_path_factory.mktemp("smollm2-lora"), rank=4, alpha=4, targets=("q_proj", "v_proj")
    )


def _mixed_workload(engine: LLMEngine, adapter: Path) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 48}
    requests: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
        ("copy", f"Repeat this text exactly, word for word:\n\n{PASSAGE}", greedy, {}),
        (
            "code",
            f"Rename the function to sum_all and keep the rest:\n\n{CODE}",
            {**greedy, "logprobs": 2},
            {},
        ),
        ("fact", "What is the capital of France? Answer in one sentence.", greedy, {}),
        ("stop", f"Repeat this text exactly:\n\n{PASSAGE}", {**greedy, "stop": ["tide"]}, {}),
        (
            "json",
            "Give the name and city of: Alice Martin lives in Lyon and works in Lyon.",
            {
                **greedy,
                "structured_outputs": {
                    "json": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                        "required": ["name", "city"],
                    }
                },
            },
            {},
        ),
        (
            "lora",
            f"Repeat this text exactly:\n\n{PASSAGE}",
            greedy,
            {"tenant": "acme", "lora": LoRARef("mine", str(adapter), "1")},
        ),
    ]
    for request_id, text, params, extra in requests:
        engine.add_request(request_id, _chat(engine, text), SamplingParams(**params), **extra)


def test_greedy_outputs_with_speculation_are_those_without_on_smollm2(
    smollm2_dir: Path, smollm2_adapter: Path
) -> None:
    plain = _smollm2_engine(smollm2_dir, None)
    _mixed_workload(plain, smollm2_adapter)
    expected_logprobs: dict[str, list] = {}
    expected = _run_checked(plain, expected_logprobs)
    del plain

    fast = _smollm2_engine(smollm2_dir, SpeculativeConfig(num_speculative_tokens=4))
    _mixed_workload(fast, smollm2_adapter)
    got_logprobs: dict[str, list] = {}
    got = _run_checked(fast, got_logprobs)

    assert set(got) == set(expected)
    for request_id, want in expected.items():
        have = got[request_id]
        assert have.outputs[0].token_ids == want.outputs[0].token_ids, request_id
        assert have.outputs[0].text == want.outputs[0].text, request_id
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason, request_id
    assert got["stop"].outputs[0].finish_reason == "stop"
    # Logprobs of the accepted drafts are those of the positions they were sampled at.
    assert len(got_logprobs["code"]) == len(got["code"].outputs[0].token_ids)
    for mine, theirs in zip(got_logprobs["code"], expected_logprobs["code"], strict=True):
        assert mine.token_id == theirs.token_id and mine.rank == theirs.rank
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    stats = fast.get_stats()
    # It did speculate, and the copying requests had most of their drafts accepted.
    assert stats["spec_num_accepted_tokens"] > 40
    assert stats["spec_mean_accepted_length"] > 1.5


def test_blocks_cached_during_speculation_hold_only_accepted_tokens(tiny_llama_dir: Path) -> None:
    """A second run of the same prompts hits the blocks the speculating run registered; its
    outputs match an engine that never speculated, so no block holds a rejected draft's KV."""

    def engine(speculative: SpeculativeConfig | None) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                cache=CacheConfig(num_blocks=96, block_size=4),
                speculative=speculative,
            )
        )

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6] * 2, [9, 10, 11, 9, 10, 11, 9, 10], list(range(20, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(e: LLMEngine, tag: str) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            e.add_request(f"{tag}{i}", prompt, params)
        out = _run_checked(e)
        return [out[f"{tag}{i}"].outputs[0].token_ids for i in range(len(prompts))]

    want = run(engine(None), "a")
    fast = engine(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    assert run(fast, "a") == want
    drafted = fast.get_stats()
    assert drafted["spec_num_draft_tokens"] > drafted["spec_num_accepted_tokens"] > 0  # some rejected
    # Prompt plus outputs as the next prompts: the whole history is a prefix-cache hit.
    prompts = [p + w[:-1] for p, w in zip(prompts, want, strict=True)]
    want_again = run(engine(None), "b")
    assert run(fast, "b") == want_again
    assert fast.scheduler.block_manager.prefix_cache_stats()["hits"] > 0


def test_constrained_drafts_are_checked_and_masked_by_the_grammar(tiny_llama_dir: Path) -> None:
    """A grammar whose output repeats itself: drafts copied from the earlier output are cut to
    what the grammar accepts, each draft position is sampled under its own mask, and the output is
    the one an engine without speculation gives (and stays in the grammar)."""
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 8, "maxItems": 8}
    params = SamplingParams(
        temperature=0.0, max_tokens=80, structured_outputs={"json": schema, "disable_any_whitespace": True}
    )

    def run(speculative: SpeculativeConfig | None) -> tuple[str, LLMEngine]:
        engine = LLMEngine(
            EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_blocks=64), speculative=speculative)
        )
        engine.add_request("c", [5, 6, 7, 8], params)
        return _run_checked(engine)["c"].outputs[0].text, engine

    want, _ = run(None)
    got, engine = run(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    assert got == want
    assert len(json.loads(got)) == 8
    stats = engine.get_stats()
    assert stats["spec_num_accepted_tokens"] > 0


def test_speculation_under_preemption_keeps_the_outputs_and_the_pool(tiny_llama_dir: Path) -> None:
    """Too few blocks for every sequence: drafts ride only where slots are free, sequences are
    preempted and recomputed, and the outputs are still those of an engine that never speculated."""

    def run(speculative: SpeculativeConfig | None) -> tuple[list[list[int]], int]:
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                cache=CacheConfig(num_blocks=14, block_size=4),
                scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64),
                speculative=speculative,
            )
        )
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for i in range(6):
            engine.add_request(f"r{i}", [7 + i, 8, 9, 7 + i, 8, 9, 7 + i], params)
        out = _run_checked(engine)
        return [out[f"r{i}"].outputs[0].token_ids for i in range(6)], engine.scheduler.num_preemptions

    want, _ = run(None)
    got, preemptions = run(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    assert got == want
    assert preemptions > 0


def test_a_sequence_whose_drafts_are_rejected_pauses_its_speculation(tiny_llama_dir: Path) -> None:
    """Sampled among three equally likely tokens, a draft copied from the earlier output is
    mostly rejected: after each window of poor acceptance the sequence pauses, longer each time."""
    cfg = SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, min_acceptance=0.5, acceptance_window=8
    )
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_blocks=64), speculative=cfg)
    )
    params = SamplingParams(
        temperature=2.0,
        top_k=3,
        logit_bias={3: 20.0, 4: 20.0, 5: 20.0},
        seed=3,
        max_tokens=200,
        ignore_eos=True,
    )
    engine.add_request("r", [3, 4, 3, 4, 3, 4, 3], params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    stats = engine.get_stats()
    assert stats["spec_acceptance_rate"] < 0.5
    # Without pauses nearly every step would verify a draft; with them, few do.
    assert 0 < stats["spec_num_drafts"] < steps / 4, (stats, steps)


# -- sampled: the distribution is unchanged ------------------------------------------------------


def test_sampled_outputs_keep_their_distribution_with_speculation(tiny_llama_dir: Path) -> None:
    """A chi-square test of the outputs' first tokens, over many seeds, with and without
    speculation. The prompt repeats itself, and the bias makes the draft's tokens likely, so most
    steps verify a draft and many drafts are rejected."""
    tokens = (17, 23, 29)
    prompt = [17, 23, 29, 17, 23, 29, 17, 23]
    params = {
        "temperature": 2.0,
        "top_k": 3,
        "logit_bias": {t: 6.0 for t in tokens},
        "max_tokens": 4,
        "ignore_eos": True,
        "n": 16,
    }

    def outcomes(speculative: SpeculativeConfig | None, first_seed: int) -> tuple[Counter, LLMEngine]:
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                cache=CacheConfig(num_blocks=256),
                scheduler=SchedulerConfig(max_num_seqs=64),
                speculative=speculative,
            )
        )
        for i in range(160):  # siblings take seed + index: every sequence has a seed of its own
            engine.add_request(f"r{i}", prompt, SamplingParams(seed=first_seed + 16 * i, **params))
        counts: Counter = Counter()
        for out in _run_checked(engine).values():
            for c in out.outputs:
                counts[tuple(c.token_ids[1:])] += 1  # the tokens after the first (a prefill's)
        return counts, engine

    plain, _ = outcomes(None, 0)
    spec, engine = outcomes(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1), 100_000)
    stats = engine.get_stats()
    assert stats["spec_num_drafts"] > 1000
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    # Cells seen fewer than 10 times in both runs are pooled, so every expected count is large.
    cells = sorted(set(plain) | set(spec))
    common = [c for c in cells if plain[c] + spec[c] >= 10]
    table = [[plain[c] for c in common], [spec[c] for c in common]]
    rare = [sum(plain[c] for c in cells if c not in common), sum(spec[c] for c in cells if c not in common)]
    if sum(rare):
        table[0].append(rare[0])
        table[1].append(rare[1])
    assert len(common) >= 10
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)
