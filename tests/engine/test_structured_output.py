"""Structured outputs in the engine: grammar bitmasks in the sampler, grammars compiled off the step
loop and cached, logit_bias; on a random-weight model (arbitrary logits: only the grammar keeps the
output valid) and on SmolLM2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampler import Sampler, apply_token_bitmask
from engine.sampling_params import SamplingParams, SamplingParamsError
from tests.structured_schemas import SCHEMAS

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_num_seqs=96)


def _validate(schema: dict, text: str) -> None:
    jsonschema.Draft202012Validator(schema).validate(json.loads(text))


def test_every_schema_of_the_corpus_gives_valid_json_on_a_random_weight_model(tiny_llm: LLM) -> None:
    assert len(SCHEMAS) >= 50
    params = [
        SamplingParams(temperature=0.0, max_tokens=256, structured_outputs={"json": schema})
        for _, schema in SCHEMAS
    ]
    outs = tiny_llm.generate(["Answer in JSON:"] * len(SCHEMAS), params)
    for (name, schema), out in zip(SCHEMAS, outs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        tokens = [tiny_llm.tokenizer.decode([t]) for t in completion.token_ids]
        try:
            _validate(schema, completion.text)
        except jsonschema.ValidationError as exc:
            raise AssertionError((name, completion.text, tokens)) from exc


def test_a_batch_mixing_constrained_and_free_requests_gives_each_its_tokens_alone(tiny_llm: LLM) -> None:
    prompts = ["The weather today", "def main():", "import os", "Once upon a time"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": PERSON}),
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(
            temperature=0.8, seed=7, max_tokens=40, structured_outputs={"regex": r"[a-z]{2,6}-\d{3}"}
        ),
        SamplingParams(temperature=0.8, seed=11, max_tokens=24),
    ]
    together = tiny_llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = tiny_llm.generate([prompt], p)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    _validate(PERSON, together[0].outputs[0].text)
    assert re.fullmatch(r"[a-z]{2,6}-\d{3}", together[2].outputs[0].text)
    # The free ones are not constrained: greedy text as without any grammar in the engine.
    assert together[1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ({"regex": r"\d{3}-[a-z]{2}"}, r"\d{3}-[a-z]{2}"),
        ({"choice": ["yes", "no", "maybe not"]}, r"yes|no|maybe not"),
        # Bounded: a random-weight model would repeat [a-c] until max_tokens.
        ({"grammar": 'root ::= "(" [a-c] [a-c]? [a-c]? ")"'}, r"\([a-c]{1,3}\)"),
    ],
)
def test_regex_choice_and_grammar_outputs_match(tiny_llm: LLM, spec: dict, pattern: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, n=3, seed=1, structured_outputs=spec)
    # n = 3 siblings each keep a matcher of their own; temperature 0: identical, and each valid.
    for completion in tiny_llm.generate(["x"], params)[0].outputs:
        assert re.fullmatch(pattern, completion.text), completion.text
        assert completion.finish_reason == "stop"


def test_json_object_gives_an_object_when_the_output_is_complete(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs={"json_object": True})
    out = tiny_llm.generate(["{"], params)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may fill an open string until max_tokens: still the start of an object
        assert out.finish_reason == "length" and out.text.startswith("{")


def test_a_grammar_ends_the_output_even_when_eos_is_ignored(tiny_llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, structured_outputs={"choice": ["alpha", "beta"]}
    )
    out = tiny_llm.generate(["x"], params)[0].outputs[0]
    assert out.text in ("alpha", "beta")
    assert out.finish_reason == "stop"


def test_min_tokens_does_not_fight_a_complete_grammar(tiny_llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=30, min_tokens=20, structured_outputs={"choice": ["alpha", "beta"]}
    )
    out = tiny_llm.generate(["x"], params)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


def test_an_invalid_schema_ends_the_request_with_an_invalid_request_error(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    spec = {"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}
    out = tiny_llm.generate(["x"], SamplingParams(structured_outputs=spec))[0]
    assert out.error_code == "invalid_request"
    assert 'Unsupported type "strin"' in out.error
    assert out.outputs[0].token_ids == []
    # Now the failure is cached: the same spec is refused at once, before anything is queued.
    with pytest.raises(InvalidRequestError, match="strin"):
        engine.add_request("again", [1, 2], SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests()


def test_a_malformed_structured_outputs_is_refused_by_the_sampling_params() -> None:
    with pytest.raises(SamplingParamsError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(SamplingParamsError, match="Unknown structured_outputs field 'guided_json'"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(SamplingParamsError, match="list of 1 to"):
        SamplingParams(structured_outputs={"choice": []})


def test_a_grammar_compiles_off_the_step_loop_while_other_requests_run(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    pool = engine.grammars.manager.pool
    with pool._cond:  # tenant "busy" holds every compile slot it may: its grammar waits
        pool._running["busy"] += 10**6
    try:
        engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6))
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}
        engine.add_request(
            "slow",
            [5, 6, 7],
            SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"json": schema}),
            tenant="busy",
        )
        finished: dict[str, str] = {}
        while "free" not in finished:  # the held compile does not keep the free request waiting
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].text
        assert "slow" in engine.grammars.waiting
        with pool._cond:
            pool._running["busy"] -= 10**6
            pool._cond.notify_all()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].text
        assert finished["slow"].startswith("[")
        _validate(schema, finished["slow"])
    finally:
        with pool._cond:
            if pool._running["busy"] >= 10**6:
                pool._running["busy"] -= 10**6
            pool._cond.notify_all()


def test_a_request_aborted_while_its_grammar_compiles_finishes_aborted(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    spec = {"regex": "[xyz]{4}w"}
    engine.add_request("gone", [3, 4], SamplingParams(structured_outputs=spec))
    engine.abort_request("gone")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("gone", True, "abort")]
    assert not engine.has_unfinished_requests()
    assert not engine.grammars.waiting


def test_grammars_are_compiled_once_per_spec_and_tenant(tiny_llm: LLM) -> None:
    manager = tiny_llm.engine.grammars.manager
    spec = {"regex": "(ab|cd){1,3}", "disable_any_whitespace": True}
    first = manager.grammar(spec, tenant="a")
    first.future.result(timeout=60)
    compiles, hits = len(manager.compile_seconds), manager.num_cache_hits
    again = manager.grammar(dict(spec), tenant="a")
    assert again is first
    assert (len(manager.compile_seconds), manager.num_cache_hits) == (compiles, hits + 1)
    manager.release(first)
    manager.release(again)


def test_logit_bias_forces_and_forbids_tokens(tiny_llm: LLM) -> None:
    free = tiny_llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids
    forced = tiny_llm.generate(
        ["hello"], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={"97": 100})
    )
    assert forced[0].outputs[0].token_ids == [97] * 4
    banned = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={free[0]: -100})
    assert tiny_llm.generate(["hello"], banned)[0].outputs[0].token_ids[0] != free[0]


def test_logit_bias_values_and_ids_are_checked() -> None:
    with pytest.raises(SamplingParamsError, match="logit_bias must be in"):
        SamplingParams(logit_bias={"5": 101})
    with pytest.raises(SamplingParamsError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(SamplingParamsError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"²": 1})  # a digit to str.isdigit(), not to int()
    with pytest.raises(SamplingParamsError, match="logit_bias must be an integer"):
        SamplingParams(logit_bias={1.5: 1})
    assert SamplingParams.from_dict(SamplingParams(logit_bias={5: 2}).to_dict()).logit_bias == {5: 2.0}


def test_logit_bias_changes_the_sample_but_not_the_raw_logprobs() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    params = [SamplingParams(temperature=0.0, logprobs=1, logit_bias={0: 10.0})]
    out = Sampler().sample(logits, params, [[1]], [[]])
    assert out.token_ids == [0]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100])
def test_the_token_bitmask_masks_exactly_the_disallowed_tokens_of_constrained_rows(vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(vocab_size)
    words = -(-vocab_size // 32)
    allowed = torch.rand(3, vocab_size, generator=gen) < 0.5
    allowed[0] = True  # a free row: every bit set
    bits = torch.zeros(3, words * 32, dtype=torch.bool)
    bits[:, :vocab_size] = allowed
    bits[0] = True
    weights = 1 << torch.arange(32, dtype=torch.int64)
    bitmask = (bits.view(3, words, 32).to(torch.int64) * weights).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    logits = torch.randn(3, vocab_size, generator=gen)
    expected = logits.masked_fill(~allowed, float("-inf"))
    rows = apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    # Bits past the vocabulary are unset in rows 1 and 2, so they count as constrained.
    assert rows == [i for i in (1, 2) if bool((bitmask[i] != -1).any())]


@pytest.mark.real_model
@pytest.mark.slow
def test_every_schema_of_the_corpus_gives_valid_json_on_smollm2(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), max_num_seqs=96)
    chats = [
        [
            {
                "role": "user",
                "content": f"Give me an example {name.replace('_', ' ')} as JSON matching: {json.dumps(s)}",
            }
        ]
        for name, s in SCHEMAS
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=256, structured_outputs={"json": s}) for _, s in SCHEMAS
    ]
    outs = llm.chat(chats, params)
    for (name, schema), out in zip(SCHEMAS, outs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        _validate(schema, completion.text)
