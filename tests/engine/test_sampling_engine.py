"""Sampling parameters through the whole engine on a real (tiny) model: seeds reproducible whatever
the batch, filters and penalties reaching the sampler, stop strings, min_tokens, streamed text."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.detokenizer import decode
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import _prompts

PROMPT = _prompts([19], seed=20)[0]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_blocks=64)


@pytest.fixture(scope="module")
def greedy_tokens(llm: LLM) -> list[int]:
    return (
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )


SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)


def test_a_seeded_request_gives_the_same_tokens_whatever_else_is_in_the_batch(
    llm: LLM, tiny_llama_dir: Path
) -> None:
    alone = llm.generate([PROMPT], SEEDED)[0].outputs[0].token_ids
    # Another engine: prompts chunked by a small budget, neighbours sampled from other seeds, a
    # neighbour sharing the prompt's first block (so the seeded one is served from the cache), the
    # seeded request at another position of the batch, and a pool small enough to preempt.
    busy = LLM(str(tiny_llama_dir), num_blocks=6, max_num_batched_tokens=16, max_num_seqs=5)
    others = [
        (PROMPT[:17] + [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)),
        (
            _prompts([33], seed=21)[0],
            SamplingParams(n=2, temperature=1.2, seed=7, max_tokens=10, ignore_eos=True),
        ),
        (_prompts([4], seed=22)[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ]
    prompts = [p for p, _ in others[:2]] + [PROMPT] + [others[2][0]]
    params = [p for _, p in others[:2]] + [SEEDED] + [others[2][1]]
    outs = busy.generate(prompts, params)
    assert outs[2].num_cached_tokens == 16 and busy.engine.scheduler.num_preemptions > 0
    assert outs[2].outputs[0].token_ids == alone
    # The seed, not luck, decides: another seed gives other tokens.
    other_seed = SamplingParams(**{**SEEDED.to_dict(), "seed": 4321})
    assert busy.generate([PROMPT], other_seed)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)],
    ids=["top_k=1", "top_p=1e-6", "min_p=1"],
)
def test_a_filter_that_leaves_one_token_samples_exactly_the_greedy_tokens(
    llm: LLM, greedy_tokens: list[int], params: SamplingParams
) -> None:
    sampled = SamplingParams(**{**params.to_dict(), "temperature": 1.0, "max_tokens": 16, "ignore_eos": True})
    assert llm.generate([PROMPT], sampled)[0].outputs[0].token_ids == greedy_tokens


def test_penalties_steer_greedy_decoding_away_from_repeats(llm: LLM, greedy_tokens: list[int]) -> None:
    repeats = len(greedy_tokens) - len(set(greedy_tokens))
    assert repeats > 0  # the tiny random model loops, so a penalty has something to change
    for penalty in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 3.0},
    ):
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **penalty)
        tokens = llm.generate([PROMPT], params)[0].outputs[0].token_ids
        assert len(tokens) - len(set(tokens)) < repeats, penalty


def test_a_stop_string_spanning_two_tokens_ends_the_output_before_it(
    llm: LLM, greedy_tokens: list[int]
) -> None:
    tok = llm.tokenizer
    pieces = [decode(tok, [t]) for t in greedy_tokens]
    # The end of one token's text and the start of the next: a string no single token holds.
    k = next(
        i
        for i in range(2, len(pieces) - 1)
        if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 1
    )
    stop = pieces[k][-2:] + pieces[k + 1][:1]
    full = decode(tok, greedy_tokens)
    cut = full.find(stop)
    assert 0 <= cut and all(stop not in p for p in pieces)

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    c = llm.generate([PROMPT], params)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, full[:cut])
    # Generation stopped at the token that completed the stop string.
    assert stop in decode(tok, c.token_ids) and stop not in decode(tok, c.token_ids[:-1])

    kept = SamplingParams(**{**params.to_dict(), "include_stop_str_in_output": True})
    assert llm.generate([PROMPT], kept)[0].outputs[0].text == full[: cut + len(stop)]


def test_min_tokens_holds_back_a_stop_token_until_reached(llm: LLM, greedy_tokens: list[int]) -> None:
    first = greedy_tokens[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first])
    c = llm.generate([PROMPT], params)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([first], "stop", first, "")

    held = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first], min_tokens=5)
    c = llm.generate([PROMPT], held)[0].outputs[0]
    assert len(c.token_ids) >= 5 and first not in c.token_ids[:5]
    assert c.finish_reason == "length" or (c.finish_reason, c.token_ids[-1]) == ("stop", first)


def test_streamed_text_deltas_of_random_samples_add_up_to_the_full_decode(llm: LLM) -> None:
    engine = llm.engine
    prompt = llm.tokenizer.encode("# 日本語のテキスト, naïve café 😀\n")
    for i in range(3):
        engine.add_request(
            f"s{i}", prompt, SamplingParams(temperature=1.5, seed=i, max_tokens=40, ignore_eos=True)
        )
    deltas: dict[str, list[str]] = {f"s{i}": [] for i in range(3)}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id].append(out.outputs[0].text_delta)
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    for request_id, c in finals.items():
        assert "".join(deltas[request_id]) == c.text == decode(llm.tokenizer, c.token_ids)


def test_offline_generate_returns_every_tokens_logprobs_for_each_sample(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([PROMPT], params)
    for c in out.outputs:
        assert [lp.token_id for lp in c.logprobs] == c.token_ids and len(c.token_ids) == 7
        assert all(len(lp.top_logprobs) == 3 for lp in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs), abs=1e-5)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None
