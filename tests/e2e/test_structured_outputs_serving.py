"""Structured outputs and tool calling through the whole stack with the official `openai` client,
on SmolLM2-135M-Instruct: `parse()` with a Pydantic model, json_schema streamed and not, a tool
round trip (call, result, answer) streamed and not, vLLM's structured_outputs extra and logit_bias."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.stack import real_model_world
from tests.structured_schemas import SCHEMAS

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.real_model, pytest.mark.django_db]

MODEL = "smollm2-structured"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=2000)


@pytest.fixture(scope="module")
def client(committed_db, smollm2_dir: Path, tmp_path_factory) -> Iterator[openai.OpenAI]:
    with real_model_world(
        committed_db, tmp_path_factory, smollm2_dir, model=MODEL, tenant="structured", max_num_seqs=16
    ) as (base, stack):
        yield stack.client(base.raw_key_a, timeout=180.0)


def _streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls assembled by index, and the finish reason of a streamed choice 0."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or call.id
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, calls, reason


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the capital and population of France as JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=100,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Capital)
    assert message.parsed == Capital.model_validate_json(message.content)
    assert completion.choices[0].finish_reason == "stop"


def test_json_schema_streamed_equals_not_streamed_and_validates(client: openai.OpenAI) -> None:
    for name, schema in SCHEMAS[:6]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Write an example {name.replace('_', ' ')} in JSON."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            },
            "temperature": 0,
            "max_tokens": 200,
        }
        whole = client.chat.completions.create(**body)
        content, calls, reason = _streamed(client.chat.completions.create(**body, stream=True))
        assert (content, calls, reason) == (
            whole.choices[0].message.content,
            {},
            whole.choices[0].finish_reason,
        )
        jsonschema.validate(json.loads(content), schema)


def test_json_object_and_the_structured_outputs_extra(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        temperature=0,
    )
    assert choice.choices[0].message.content in ("yes", "no")
    code = client.completions.create(
        model=MODEL,
        prompt="The flight number is",
        extra_body={"structured_outputs": {"regex": r" [A-Z]{2}[0-9]{3,4}"}},
        temperature=0,
        max_tokens=10,
    )
    assert code.choices[0].text[0] == " " and code.choices[0].text[1:3].isupper()


def test_an_invalid_schema_is_a_400_naming_the_problem(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "bad",
                    "schema": {"type": "object", "properties": {"a": {"type": "strin"}}},
                },
            },
        )
    assert refused.value.body["param"] == "response_format"
    assert 'Unsupported type "strin"' in refused.value.body["message"]


def test_logit_bias_steers_the_answer(client: openai.OpenAI, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(smollm2_dir).encode(" banana", add_special_tokens=False)
    reply = client.completions.create(
        model=MODEL,
        prompt="My favourite fruit is",
        logit_bias={str(tokens[0]): 100},
        temperature=0,
        max_tokens=3,
    )
    assert reply.choices[0].text.startswith(" banana")


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_call_result_answer(client: openai.OpenAI, stream: bool) -> None:
    first = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "temperature": 0,
    }
    if stream:
        _, calls, reason = _streamed(client.chat.completions.create(**first, stream=True))
        call = calls[0]
        call_id, name, arguments = call["id"], call["name"], call["arguments"]
    else:
        reply = client.chat.completions.create(**first)
        reason = reply.choices[0].finish_reason
        assert reply.choices[0].message.content is None
        [tool_call] = reply.choices[0].message.tool_calls
        call_id, name, arguments = tool_call.id, tool_call.function.name, tool_call.function.arguments
    assert reason == "tool_calls"
    assert name == "get_weather"
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = {
        "model": MODEL,
        "messages": history,
        "tools": [WEATHER, TIME],
        "temperature": 0,
        "max_tokens": 60,
    }
    if stream:
        content, calls, reason = _streamed(client.chat.completions.create(**second, stream=True))
    else:
        answer = client.chat.completions.create(**second)
        content, calls, reason = answer.choices[0].message.content, {}, answer.choices[0].finish_reason
    assert calls == {} and reason in ("stop", "length")
    assert "21" in content or "sunny" in content.lower()


def test_a_named_tool_choice_streams_its_arguments(client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 0,
    }
    whole = client.chat.completions.create(**body).choices[0]
    _, calls, reason = _streamed(client.chat.completions.create(**body, stream=True))
    [call] = whole.message.tool_calls
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (
        "get_time",
        json.loads(call.function.arguments),
    )
    assert reason == whole.finish_reason == "tool_calls"
    assert "timezone" in json.loads(call.function.arguments)
