"""A Messages body read into the chat completion body it asks for (inference.api.anthropic.translate),
and what the chat format cannot carry refused with the Messages field's name."""

from __future__ import annotations

import json

import pytest

from core.errors import InvalidRequestError
from inference.api.anthropic.translate import chat_body, count_tokens_body

TOOL = {
    "name": "get_weather",
    "description": "Weather.",
    "input_schema": {"type": "object", "properties": {}},
}


def test_a_conversation_with_a_tool_round_trip_becomes_chat_messages() -> None:
    body = {
        "model": "m",
        "max_tokens": 100,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "...", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "21C"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"],
        "temperature": 0.5,
        "top_k": 40,
        "metadata": {"user_id": "user-7"},
        "stream": True,
        "container": "ignored",
    }
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    # The server tool is left out; the custom one is a function.
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": TOOL["input_schema"],
                "description": "Weather.",
            },
        }
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["max_completion_tokens"] == 100 and chat["stop"] == ["\n\n"]
    assert (chat["temperature"], chat["top_k"], chat["user"], chat["stream"]) == (0.5, 40, "user-7", True)
    assert "container" not in chat


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choices_map_to_chat_tool_choices(choice, expected) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
    assert chat_body({**body, "tool_choice": choice})["tool_choice"] == expected


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"max_tokens": None}, "max_tokens", "positive integer is required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "Extended thinking"),
        ({"frequency_penalty": 1}, "frequency_penalty", "Extra inputs are not permitted"),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "user or assistant"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0",
            "image blocks are not supported",
        ),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name", "not in tools"),
        ({"tool_choice": "auto"}, "tool_choice", "object with a type"),
        ({"tools": [{"name": "t"}]}, "tools.0.input_schema", "JSON schema object"),
    ],
)
def test_what_the_chat_format_cannot_carry_is_refused_by_its_messages_name(change, param, message) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(InvalidRequestError, match=message) as refused:
        chat_body(body)
    assert refused.value.param == param


def test_an_output_format_is_a_json_schema_response_format_and_anthropic_extras_are_ignored() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    chat = chat_body(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}},
            "cache_control": {"type": "ephemeral"},
            "speed": "fast",
            "inference_geo": "us",
        }
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert not {"cache_control", "speed", "inference_geo", "output_config"} & set(chat)
    with pytest.raises(InvalidRequestError) as refused:
        chat_body(
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "output_config": {"format": {"type": "regex"}},
            }
        )
    assert refused.value.param == "output_config.format"


def test_count_tokens_takes_the_prompt_fields_only() -> None:
    fields = count_tokens_body({"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "s"})
    assert fields == {
        "model": "m",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
    }
    with pytest.raises(InvalidRequestError, match="Extra inputs"):
        count_tokens_body({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
