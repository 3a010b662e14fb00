from __future__ import annotations

import json

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert p.is_greedy is False


def test_a_single_stop_string_is_wrapped_in_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []


def test_top_k_minus_one_means_off_and_is_stored_as_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_is_temperature_below_epsilon():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_max_stop_str_len_is_the_longest_stop_string():
    assert SamplingParams(stop=["a", "abcd", "ab"]).max_stop_str_len == 4
    assert SamplingParams().max_stop_str_len == 0


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 1.0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"seed": "7"}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens of 16
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.param == param
    assert isinstance(exc.value, ValueError)


def test_boundary_values_are_accepted():
    p = SamplingParams(
        n=128,
        temperature=2,
        top_p=1,
        top_k=1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=3.0,
        seed=-5,
        stop=["a", "b", "c", "d"],
        logprobs=20,
        max_tokens=5,
        min_tokens=5,
    )
    assert p.temperature == 2.0 and isinstance(p.temperature, float)
    assert p.logprobs == 20 and p.min_tokens == p.max_tokens == 5


def test_round_trip_through_json_keeps_every_field():
    p = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=1234,
        stop=["\n\n", "###"],
        stop_token_ids=[7, 9],
        ignore_eos=True,
        max_tokens=100,
        min_tokens=3,
        logprobs=5,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    wire = json.dumps(p.to_dict())
    assert SamplingParams.from_dict(json.loads(wire)) == p


def test_from_dict_fills_defaults_and_refuses_unknown_fields():
    assert SamplingParams.from_dict({"max_tokens": 3}) == SamplingParams(max_tokens=3)
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams.from_dict({"best_of": 2})
    assert exc.value.param == "best_of"


def test_from_dict_validates_like_the_constructor():
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams.from_dict({"temperature": 3})
    assert exc.value.param == "temperature"
