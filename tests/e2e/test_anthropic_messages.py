"""The Anthropic Messages API (/v1/messages) through the whole stack with the official `anthropic`
SDK, on SmolLM2-135M-Instruct: messages.create and messages.stream (the same greedy text as chat
completions), stop reasons, a tool_use / tool_result round trip streamed and not, count_tokens,
the models list in Anthropic's shape, and errors raised as the SDK's exception types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.stack import ServingStack, real_model_world

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.real_model, pytest.mark.django_db]

MODEL = "smollm2-messages"
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"],
    },
}
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
# Greedy: the current SDK has no temperature argument (older ones and raw clients send it).
GREEDY = {"extra_body": {"temperature": 0}}


@dataclass
class Messages:
    stack: ServingStack
    raw_key: str
    client: anthropic.Anthropic
    chat: openai.OpenAI


@pytest.fixture(scope="module")
def api(committed_db, smollm2_dir: Path, tmp_path_factory) -> Iterator[Messages]:
    with real_model_world(
        committed_db, tmp_path_factory, smollm2_dir, model=MODEL, tenant="messages", max_num_seqs=8
    ) as (base, stack):
        client = anthropic.Anthropic(
            base_url=stack.base_url, api_key=base.raw_key_a, max_retries=0, timeout=180.0
        )
        yield Messages(stack, base.raw_key_a, client, stack.client(base.raw_key_a, timeout=180.0))


def test_a_message_answers_as_the_chat_completion_does(api: Messages) -> None:
    reply = api.client.messages.create(model=MODEL, max_tokens=64, messages=PARIS, **GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == "The capital of France is Paris."
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert reply.usage.output_tokens == 8  # seven tokens of text and <|im_end|>
    chat = api.chat.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=64)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert reply.id.startswith("msg_")


def test_the_system_prompt_as_text_or_blocks_is_the_chat_system_message(api: Messages) -> None:
    system = "You answer in French."
    as_text = api.client.messages.create(model=MODEL, max_tokens=32, system=system, messages=PARIS, **GREEDY)
    as_blocks = api.client.messages.create(
        model=MODEL, max_tokens=32, system=[{"type": "text", "text": system}], messages=PARIS, **GREEDY
    )
    chat = api.chat.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system}, *PARIS], temperature=0, max_tokens=32
    )
    assert as_text.content[0].text == as_blocks.content[0].text == chat.choices[0].message.content


@pytest.mark.parametrize(
    "content",
    ["Write a haiku about autumn leaves.", "用一句话介绍一下北京。", "Name three colors of the sea 🌊"],
)
def test_the_streamed_message_equals_the_whole_one(api: Messages, content: str) -> None:
    messages = [{"role": "user", "content": content}]
    whole = api.client.messages.create(model=MODEL, max_tokens=24, messages=messages, **GREEDY)
    with api.client.messages.stream(model=MODEL, max_tokens=24, messages=messages, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_reasons_say_why_the_message_ended(api: Messages) -> None:
    at_stop = api.client.messages.create(
        model=MODEL, max_tokens=64, messages=PARIS, **GREEDY, stop_sequences=["Paris"]
    )
    assert at_stop.stop_reason == "stop_sequence" and at_stop.stop_sequence == "Paris"
    assert at_stop.content[0].text == "The capital of France is "
    cut = api.client.messages.create(model=MODEL, max_tokens=3, messages=PARIS, **GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_use_result_answer(api: Messages, stream: bool) -> None:
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = {"model": MODEL, "max_tokens": 80, "messages": ask, "tools": [WEATHER, TIME], **GREEDY}
    if stream:
        with api.client.messages.stream(**first, tool_choice={"type": "any"}) as events:
            reply = events.get_final_message()
    else:
        reply = api.client.messages.create(**first, tool_choice={"type": "any"})
    assert reply.stop_reason == "tool_use"
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [
        *ask,
        {"role": "assistant", "content": [block.model_dump() for block in reply.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": json.dumps({"temperature": 21, "sky": "sunny"}),
                }
            ],
        },
    ]
    answer = api.client.messages.create(**{**first, "messages": history})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    text = "".join(block.text for block in answer.content if block.type == "text")
    assert "21" in text or "sunny" in text.lower()


def test_a_named_tool_streams_its_input_as_json_deltas(api: Messages) -> None:
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    request = {
        "model": MODEL,
        "max_tokens": 60,
        "messages": ask,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "tool", "name": "get_time"},
        **GREEDY,
    }
    whole = api.client.messages.create(**request)
    partial = []
    with api.client.messages.stream(**request) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()
    [use] = whole.content
    assert use.type == "tool_use" and use.name == "get_time"
    assert final.content[0].input == use.input == json.loads("".join(partial))
    assert final.stop_reason == whole.stop_reason == "tool_use"


class Capital(BaseModel):
    country: str
    capital: str


def test_parse_with_a_pydantic_model_answers_in_its_schema(api: Messages) -> None:
    """messages.parse sends the model's JSON schema as output_config.format: a grammar holds the
    answer to it."""
    reply = api.client.messages.parse(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Which country has Paris as its capital?"}],
        output_format=Capital,
        **GREEDY,
    )
    assert isinstance(reply.parsed_output, Capital)
    assert reply.parsed_output.capital and reply.parsed_output.country


def test_count_tokens_counts_the_prompt_a_message_would_have(api: Messages) -> None:
    counted = api.client.messages.count_tokens(model=MODEL, messages=PARIS, system="Be brief.")
    reply = api.client.messages.create(
        model=MODEL, max_tokens=4, messages=PARIS, system="Be brief.", **GREEDY
    )
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    with_tools = api.client.messages.count_tokens(model=MODEL, messages=PARIS, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_the_models_list_speaks_anthropic_when_asked_in_anthropic(api: Messages) -> None:
    models = api.client.models.list()
    assert MODEL in [m.id for m in models.data]
    assert all(m.type == "model" for m in models.data)


def test_a_bearer_key_and_beta_headers_are_accepted(api: Messages) -> None:
    response = httpx.post(
        api.stack.base_url + "/v1/messages",
        headers={
            "Authorization": f"Bearer {api.raw_key}",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14",
        },
        json={"model": MODEL, "max_tokens": 8, "messages": PARIS, "temperature": 0},
        timeout=180,
    )
    assert response.status_code == 200, response.text
    assert response.headers["request-id"] == response.headers["x-request-id"]
    assert response.json()["content"][0]["text"].startswith("The capital")


def test_errors_are_anthropic_errors(api: Messages) -> None:
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        anthropic.Anthropic(base_url=api.stack.base_url, api_key="sk-nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=PARIS
        )
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        api.client.messages.create(model="no-such-model", max_tokens=8, messages=PARIS)
    assert unknown.value.body["type"] == "error" and unknown.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        api.client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.BadRequestError, match="Extended thinking is not supported"):
        api.client.messages.create(
            model=MODEL, max_tokens=2048, messages=PARIS, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        api.client.post("/v1/messages", body={"model": MODEL, "messages": PARIS}, cast_to=httpx.Response)


def _claude_code_body(stream: bool) -> dict:
    """A request shaped as Claude Code sends it (public proxy logs record the shape): system text
    blocks with cache_control, a user turn of a system-reminder block and the prompt, custom tools
    with draft-07 schemas, metadata.user_id as a JSON string longer than 64 characters, and a
    max_tokens of 32,000, far above this model's context."""
    session = {
        "device_id": "d" * 64,
        "account_uuid": "",
        "session_id": "5a0c6f0e-6d4c-4a55-9b8e-1f2a3b4c5d6e",
    }
    schema = "http://json-schema.org/draft-07/schema#"
    return {
        "model": MODEL,
        "max_tokens": 32000,
        "stream": stream,
        "temperature": 1,
        "system": [
            {"type": "text", "text": "You are a coding assistant.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use the tools to answer.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>No project notes.</system-reminder>"},
                    {
                        "type": "text",
                        "text": "Read the file README.md.",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            }
        ],
        "tools": [
            {
                "name": "Read",
                "description": "Reads a file from the local filesystem.",
                "input_schema": {
                    "$schema": schema,
                    "type": "object",
                    "properties": {"file_path": {"type": "string", "description": "The absolute path."}},
                    "required": ["file_path"],
                    "additionalProperties": False,
                },
            },
            {
                "name": "Bash",
                "description": "Runs a shell command.",
                "input_schema": {
                    "$schema": schema,
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                    "additionalProperties": False,
                },
            },
        ],
        "metadata": {"user_id": json.dumps(session)},
    }


CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
    "x-app": "cli",
    "user-agent": "claude-cli/2.1.0 (external, cli)",
}


def test_a_claude_code_request_is_answered_whole_and_streamed(api: Messages) -> None:
    headers = {**CLAUDE_CODE_HEADERS, "x-api-key": api.raw_key}
    whole = httpx.post(
        api.stack.base_url + "/v1/messages", headers=headers, json=_claude_code_body(False), timeout=300
    )
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["stop_reason"] in ("end_turn", "tool_use", "max_tokens") and body["content"]
    with httpx.stream(
        "POST",
        api.stack.base_url + "/v1/messages",
        headers=headers,
        json=_claude_code_body(True),
        timeout=300,
    ) as streamed:
        assert streamed.status_code == 200
        text = streamed.read().decode()
    names = [block.split("\n", 1)[0].removeprefix("event: ") for block in text.split("\n\n") if block]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    delta = json.loads(text.split("event: message_delta\ndata: ", 1)[1].split("\n", 1)[0])
    assert delta["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens")
    assert delta["usage"]["output_tokens"] > 0
