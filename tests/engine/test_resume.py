"""A request continued from what a lost replica had streamed (engine.resume): the continuation is
the undisturbed run's, for everything that depends on the outputs so far."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.protocol import Event
from engine.resume import Resume, derived_seed
from engine.sampling_params import SamplingParams

PROMPT = [0, 300, 301, 302, 303, 304, 305, 306, 307]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_blocks=64)))


class Run:
    """Every output of one request, step by step."""

    def __init__(self, engine: LLMEngine, request_id: str, params: SamplingParams, **kwargs) -> None:
        engine.add_request(request_id, kwargs.pop("prompt", PROMPT), params, **kwargs)
        self.outputs = []
        while engine.has_unfinished_requests():
            self.outputs.extend(o for o in engine.step() if o.request_id == request_id)
        self.final = self.outputs[-1]

    def tokens(self, index: int = 0) -> list[int]:
        return [t for o in self.outputs for c in o.outputs if c.index == index for t in c.token_ids_delta]

    def steps(self, index: int = 0) -> list[tuple[list[int], str]]:
        """(tokens, text) streamed per step."""
        return [
            (list(c.token_ids_delta), c.text_delta)
            for o in self.outputs
            for c in o.outputs
            if c.index == index and (c.token_ids_delta or c.text_delta)
        ]


def resumed(tokens: list[int], n: int = 1) -> Resume:
    return Resume(outputs=(tuple(tokens),) + ((),) * (n - 1))


def test_a_greedy_continuation_is_the_undisturbed_run_with_its_penalties_counting_outputs(engine) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=1.0,
        repetition_penalty=1.3,
        min_tokens=16,
    )
    undisturbed = Run(engine, "whole", params).tokens()
    k = 10

    continued = Run(engine, "continued", params, resume=resumed(undisturbed[:k]))
    # The same tokens fed as prompt instead: frequency and presence penalties no longer see them.
    as_prompt = Run(
        engine,
        "as-prompt",
        SamplingParams(**{**params.to_dict(), "max_tokens": 24 - k, "min_tokens": 6}),
        prompt=PROMPT + undisturbed[:k],
    )

    assert continued.tokens() == undisturbed[k:]
    assert continued.final.outputs[0].token_ids == undisturbed  # the whole output, max_tokens counted over it
    assert continued.final.outputs[0].finish_reason == "length"
    assert as_prompt.tokens() != undisturbed[k:]


def test_a_stop_string_held_back_at_the_boundary_is_still_found(engine) -> None:
    free = Run(engine, "free", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    steps = free.steps()
    text = "".join(t for _, t in steps)
    # A stop string of the end of one step's text and the start of the next's, found nowhere earlier.
    ends = [len("".join(t for _, t in steps[: i + 1])) for i in range(len(steps))]
    for k in range(len(ends) - 1):
        end = ends[k]
        stop = text[end - 2 : end + 2]
        if len(stop) == 4 and text.find(stop) == end - 2 and stop.strip() == stop:
            break
    else:
        pytest.skip("no step boundary of this output makes a usable stop string")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    undisturbed = Run(engine, "stopped", params)
    sent_tokens = [t for tokens, _ in steps[: k + 1] for t in tokens]
    # What the undisturbed run had streamed after those tokens: the stop string's start is held back.
    sent_text = "".join(c.text_delta for o in undisturbed.outputs[: k + 1] for c in o.outputs)

    continued = Run(engine, "stopped-continued", params, resume=resumed(sent_tokens))

    assert not sent_text.endswith(stop[:2])
    assert sent_text + "".join(t for _, t in continued.steps()) == text[: end - 2]
    assert continued.final.outputs[0].text == undisturbed.final.outputs[0].text == text[: end - 2]
    assert continued.final.outputs[0].stop_reason == stop


def test_a_grammar_is_advanced_through_the_streamed_tokens(engine) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=30, structured_outputs={"regex": "[a-z]{3,12}-[0-9]{2,4}"}
    )
    undisturbed = Run(engine, "grammar", params)
    tokens = undisturbed.tokens()
    assert len(tokens) > 4

    continued = Run(engine, "grammar-continued", params, resume=resumed(tokens[:3]))

    assert continued.tokens() == tokens[3:]
    assert re.fullmatch("[a-z]{3,12}-[0-9]{2,4}", continued.final.outputs[0].text)


def test_siblings_continue_and_one_that_had_ended_is_not_run_again(engine) -> None:
    eos = engine.eos_token_ids[0]
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12)
    resume = Resume(outputs=((400, 401, 402), (500, 501, eos)))

    run = Run(engine, "siblings", params, resume=resume)

    first, second = run.final.outputs
    assert first.token_ids[:3] == [400, 401, 402] and first.finish_reason is not None
    assert len(first.token_ids) == 12 or first.finish_reason == "stop"
    assert (second.token_ids, second.finish_reason) == ([500, 501, eos], "stop")
    assert run.tokens(1) == []  # nothing more was generated for it
    assert run.tokens(0) == first.token_ids[3:]


def test_a_request_every_sibling_of_which_had_ended_finishes_at_the_next_step(engine) -> None:
    eos = engine.eos_token_ids[0]
    run = Run(engine, "all-ended", SamplingParams(max_tokens=5), resume=resumed([400, eos]))

    assert run.final.finished and len(run.outputs) == 1
    assert (run.final.outputs[0].token_ids, run.final.outputs[0].finish_reason) == ([400, eos], "stop")
    assert run.tokens() == []


def test_a_seeded_continuation_uses_a_derived_seed_and_repeats_itself(engine) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    undisturbed = Run(engine, "seeded", params).tokens()

    again = [Run(engine, f"seeded-{i}", params, resume=resumed(undisturbed[:6])).tokens() for i in range(2)]

    assert resumed(undisturbed[:6]).sampling_params(params).seed == derived_seed(1234, 6) != 1234
    assert again[0] == again[1] and len(again[0]) == 10


def test_prompt_logprobs_already_sent_are_not_sent_again_and_token_logprobs_go_on(engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1, logprobs=2)
    resume = Resume(outputs=((400, 401),), prompt_logprobs_sent=True)

    run = Run(engine, "prompt-logprobs", params, resume=resume)

    assert [o.prompt_logprobs for o in run.outputs] == [None] * len(run.outputs)
    assert run.final.outputs[0].token_ids[:2] == [400, 401] and len(run.final.outputs[0].token_ids) == 6
    # Token logprobs go on from the next token: one per new token, none for the streamed ones.
    logprobs = [lp for o in run.outputs for c in o.outputs for lp in c.logprobs_delta or ()]
    assert [lp.token_id for lp in logprobs] == run.tokens() == run.final.outputs[0].token_ids[2:]


def test_a_resume_is_read_from_an_output_stream() -> None:
    events = [
        Event.delta([]),
        Event(type="delta", outputs=[{"index": 0, "text": "a", "token_ids": [5, 6]}], prompt_logprobs=[None]),
        Event(type="delta", outputs=[{"index": 1, "text": "b", "token_ids": [7]}]),
        Event.failover("r2"),
        Event(type="delta", outputs=[{"index": 0, "text": "c", "token_ids": [8]}]),
        Event.failover("r3"),
    ]

    resume = Resume.from_events(events, 2)

    assert resume == Resume(outputs=((5, 6, 8), (7,)), prompt_logprobs_sent=True, failovers=2)
    assert Resume.from_events([Event.failover("r2")], 1) is None  # nothing streamed: run from the start
    with pytest.raises(InvalidRequestError):
        Resume.from_events([Event(type="delta", outputs=[{"index": 3, "token_ids": [1]}])], 2)


def test_resumed_tokens_out_of_the_vocabulary_are_refused(engine) -> None:
    with pytest.raises(InvalidRequestError, match="resumed output token ids"):
        engine.add_request("bad-resume", PROMPT, SamplingParams(max_tokens=4), resume=resumed([10**6]))
    assert not engine.has_unfinished_requests()


def test_min_tokens_counts_the_streamed_tokens(engine) -> None:
    free = Run(engine, "free-min", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)).tokens()
    position = next(i for i in range(4, 12) if free[i] not in free[:i])
    stop = free[position]
    # Allowed to stop from the token at `position` on, where it samples `stop`.
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop], min_tokens=position
    )
    undisturbed = Run(engine, "min", params)
    assert undisturbed.tokens() == free[: position + 1]

    continued = Run(engine, "min-continued", params, resume=resumed(free[: position - 1]))

    # All but one of min_tokens were streamed already: the next token meets it, the stop token
    # after it ends the output where it did.
    assert continued.tokens() == free[position - 1 : position + 1]
    assert (continued.final.outputs[0].finish_reason, continued.final.outputs[0].stop_reason) == (
        "stop",
        stop,
    )
