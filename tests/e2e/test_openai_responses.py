"""OpenAI's Responses API (/v1/responses) through the whole stack with the official `openai` SDK,
on SmolLM2-135M-Instruct: responses.create, responses.stream (the same greedy text as chat
completions), responses.parse with a Pydantic model, function-call round trips, previous_response_id
over stored responses, retrieve / delete / input_items, another tenant's id as a 404, a
Codex-shaped request, and errors raised as the SDK's exception types."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from inference.models import StoredResponse
from tenants.models import UsageRecord
from tests.e2e.stack import ServingStack, real_model_world
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.real_model, pytest.mark.django_db]

MODEL = "smollm2-responses"
WEATHER = {
    "type": "function",
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
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The current time in a timezone.",
    "parameters": {
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"],
        "additionalProperties": False,
    },
    "strict": True,
}
PARIS = "What is the capital of France?"


@dataclass
class Responses:
    stack: ServingStack
    raw_key: str
    client: openai.OpenAI
    other: openai.OpenAI  # another tenant's client


@pytest.fixture(scope="module")
def api(committed_db, smollm2_dir: Path, tmp_path_factory) -> Iterator[Responses]:
    with real_model_world(
        committed_db, tmp_path_factory, smollm2_dir, model=MODEL, tenant="responses", max_num_seqs=8
    ) as (base, stack):
        yield Responses(
            stack,
            base.raw_key_a,
            stack.client(base.raw_key_a, timeout=180.0),
            stack.client(base.raw_key_b, timeout=180.0),
        )


def test_a_response_answers_as_the_chat_completion_does(api: Responses) -> None:
    reply = api.client.responses.create(model=MODEL, input=PARIS, temperature=0, max_output_tokens=64)
    assert reply.object == "response" and reply.status == "completed" and reply.model == MODEL
    assert reply.id.startswith("resp_") and reply.error is None and reply.incomplete_details is None
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert reply.output_text == "The capital of France is Paris."
    chat = api.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PARIS}], temperature=0, max_tokens=64
    )
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens


def test_a_response_is_billed_and_traced_as_a_chat_completion(api: Responses) -> None:
    raw = api.client.responses.with_raw_response.create(
        model=MODEL, input=PARIS, max_output_tokens=8, safety_identifier="user-7", service_tier="flex"
    )
    reply = raw.parse()
    request_id = raw.headers["x-request-id"]
    assert reply.id == f"resp_{request_id}" and reply.service_tier == "flex"
    assert raw.headers["x-ratelimit-limit-requests"]
    row = wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).first(), timeout=60)
    assert (row.prompt_tokens, row.completion_tokens) == (reply.usage.input_tokens, reply.usage.output_tokens)
    assert (row.end_user, row.service_tier, row.model) == ("user-7", "flex", MODEL)


def test_instructions_and_message_items_are_the_chat_messages(api: Responses) -> None:
    system = "You answer in French."
    as_items = api.client.responses.create(
        model=MODEL,
        instructions=system,
        input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": PARIS}]}],
        temperature=0,
        max_output_tokens=32,
    )
    chat = api.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": PARIS}],
        temperature=0,
        max_tokens=32,
    )
    assert as_items.output_text == chat.choices[0].message.content
    assert as_items.instructions == system


@pytest.mark.parametrize(
    "content",
    ["Write a haiku about autumn leaves.", "用一句话介绍一下北京。", "Name three colors of the sea 🌊"],
)
def test_the_streamed_response_equals_the_whole_one(api: Responses, content: str) -> None:
    whole = api.client.responses.create(model=MODEL, input=content, temperature=0, max_output_tokens=24)
    with api.client.responses.stream(
        model=MODEL, input=content, temperature=0, max_output_tokens=24
    ) as stream:
        events = list(stream)
    # The SDK's get_final_response() takes only response.completed; a response cut by
    # max_output_tokens ends with response.incomplete, as OpenAI's do.
    final = events[-1].response
    assert events[-1].type == f"response.{whole.status}"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_cut_response_is_incomplete_with_the_reason(api: Responses) -> None:
    cut = api.client.responses.create(model=MODEL, input=PARIS, temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    with api.client.responses.stream(model=MODEL, input=PARIS, temperature=0, max_output_tokens=3) as stream:
        names = [event.type for event in stream]
    assert names[-1] == "response.incomplete"


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip(api: Responses, stream: bool) -> None:
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = {
        "model": MODEL,
        "input": ask,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 80,
        "store": False,
    }
    if stream:
        arguments = []
        with api.client.responses.stream(**first) as events:
            for event in events:
                if event.type == "response.function_call_arguments.delta":
                    arguments.append(event.delta)
            reply = events.get_final_response()
    else:
        reply = api.client.responses.create(**first)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    if stream:
        assert "".join(arguments) == calls[0].arguments
    history = [
        *ask,
        *[item.model_dump(exclude_none=True) for item in reply.output],
        {
            "type": "function_call_output",
            "call_id": calls[0].call_id,
            "output": json.dumps({"temperature": 21, "sky": "sunny"}),
        },
    ]
    answer = api.client.responses.create(**{**first, "input": history, "tool_choice": "auto"})
    assert answer.status in ("completed", "incomplete")
    assert "21" in answer.output_text or "sunny" in answer.output_text.lower()


def test_a_named_function_streams_its_arguments(api: Responses) -> None:
    request = {
        "model": MODEL,
        "input": "What time is it in Tokyo?",
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "name": "get_time"},
        "temperature": 0,
        "max_output_tokens": 60,
    }
    whole = api.client.responses.create(**request)
    with api.client.responses.stream(**request) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_time"
    assert final.output[0].arguments == call.arguments == done[0].arguments
    assert json.loads(call.arguments)["timezone"]


class Capital(BaseModel):
    country: str
    capital: str


def test_parse_with_a_pydantic_model_answers_in_its_schema(api: Responses) -> None:
    reply = api.client.responses.parse(
        model=MODEL,
        input="Which country has Paris as its capital?",
        text_format=Capital,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(reply.output_parsed, Capital)
    assert reply.output_parsed.capital and reply.output_parsed.country


def test_previous_response_id_continues_the_conversation(api: Responses) -> None:
    first = api.client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="My name is Ada. Say hello.",
        temperature=0,
        max_output_tokens=24,
    )
    second = api.client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="What is my name?",
        temperature=0,
        max_output_tokens=24,
    )
    assert second.previous_response_id == first.id
    # The same conversation sent as history gives the same answer (instructions are not carried).
    history = api.client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "My name is Ada. Say hello."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        temperature=0,
        max_output_tokens=24,
        store=False,
    )
    assert history.output_text == second.output_text
    assert history.usage.input_tokens == second.usage.input_tokens
    # The same prompt again: read from the prefix cache.
    assert history.usage.input_tokens_details.cached_tokens > 0
    third = api.client.responses.create(
        model=MODEL, previous_response_id=second.id, input="Spell it.", temperature=0, max_output_tokens=24
    )
    stored = StoredResponse.objects.get(id=third.id)
    assert (stored.root_id, stored.depth, stored.previous_id) == (first.id, 2, second.id)


def test_a_streamed_response_is_stored_before_it_completes(api: Responses) -> None:
    with api.client.responses.stream(model=MODEL, input="Count to three.", max_output_tokens=16) as stream:
        final = stream.get_final_response()
    # Straight after the last event, as a client's next turn would.
    assert api.client.responses.retrieve(final.id).output_text == final.output_text
    follow = api.client.responses.create(
        model=MODEL, previous_response_id=final.id, input="And to four?", max_output_tokens=8
    )
    assert follow.previous_response_id == final.id


def test_retrieve_input_items_and_delete(api: Responses) -> None:
    reply = api.client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": PARIS},
        ],
        temperature=0,
        max_output_tokens=16,
        metadata={"run": "42"},
    )
    got = api.client.responses.retrieve(reply.id)
    assert got.id == reply.id and got.output_text == reply.output_text and got.metadata == {"run": "42"}
    items = api.client.responses.input_items.list(reply.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [
        ("user", "Hello."),
        ("assistant", "Hi! How can I help?"),
        ("user", PARIS),
    ]
    newest_first = api.client.responses.input_items.list(reply.id, limit=2)
    assert [i.id for i in newest_first.data] == [items.data[2].id, items.data[1].id]
    assert newest_first.has_more is True
    rest = api.client.responses.input_items.list(reply.id, limit=2, after=newest_first.data[-1].id)
    assert [i.id for i in rest.data] == [items.data[0].id] and rest.has_more is False
    deleted = api.client.responses.delete(reply.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        api.client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        api.client.responses.delete(reply.id)


def test_store_false_keeps_nothing(api: Responses) -> None:
    reply = api.client.responses.create(model=MODEL, input=PARIS, max_output_tokens=4, store=False)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError):
        api.client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|No response"):
        api.client.responses.create(
            model=MODEL, previous_response_id=reply.id, input="Hi", max_output_tokens=4
        )


def test_another_tenants_response_is_not_found(api: Responses) -> None:
    mine = api.client.responses.create(model=MODEL, input=PARIS, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        api.other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        api.other.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError):
        api.other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        api.other.responses.create(model=MODEL, previous_response_id=mine.id, input="Hi", max_output_tokens=4)
    assert api.client.responses.retrieve(mine.id).id == mine.id


def test_an_empty_probe_gets_an_answer(api: Responses) -> None:
    for probe in ("", []):
        reply = api.client.responses.create(model=MODEL, input=probe, max_output_tokens=1, store=False)
        assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens <= 1


def test_hosted_tools_are_left_out_and_background_is_refused(api: Responses) -> None:
    reply = api.client.responses.create(
        model=MODEL,
        input=PARIS,
        tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}],
        temperature=0,
        max_output_tokens=64,
        store=False,
    )
    assert reply.output_text == "The capital of France is Paris."
    with pytest.raises(openai.BadRequestError, match="background") as refused:
        api.client.responses.create(model=MODEL, input=PARIS, background=True)
    assert refused.value.param == "background"
    with pytest.raises(openai.BadRequestError, match="input_image"):
        api.client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}],
        )
    with pytest.raises(openai.NotFoundError):
        api.client.responses.create(model="no-such-model", input=PARIS)


def _codex_body(model: str) -> dict:
    """A request as the Codex command-line program sends it (its twelve fields, recorded in
    webai-at-home#214 and #213): a long instructions text, developer and user message items,
    function tools beside a freeform custom tool and a hosted web search, reasoning with encrypted
    content asked for, store false, streamed; no temperature, top_p or max_output_tokens."""
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "workdir": {"type": "string"},
                "timeout_ms": {"type": "number"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    }
    plan = {
        "type": "function",
        "name": "update_plan",
        "description": "Updates the task plan.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "explanation": {"type": "string"},
                "plan": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["plan"],
            "additionalProperties": False,
        },
    }
    patch = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edits files with a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
    }
    return {
        "model": model,
        "instructions": "You are a coding agent running in a terminal. " * 40,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [
                    {
                        "type": "input_text",
                        "text": "<permissions instructions>read-only</permissions instructions>",
                    }
                ],
            },
            {
                "type": "message",
                "role": "user",
                "content": [
                    {
                        "type": "input_text",
                        "text": "<environment_context><cwd>/work</cwd></environment_context>",
                    }
                ],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Reply with the word ready."}],
            },
        ],
        "tools": [shell, plan, patch, {"type": "web_search"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0b3d4c5e-6f70-4182-93a4-b5c6d7e8f901",
        "client_metadata": {"x-codex-installation-id": "c0dex"},
    }


def test_a_codex_request_is_answered_streamed_with_its_function_tools(api: Responses) -> None:
    body = _codex_body(MODEL)
    assert len(body) == 12
    with httpx.stream(
        "POST",
        api.stack.base_url + "/v1/responses",
        headers={"Authorization": f"Bearer {api.raw_key}", "originator": "codex_cli_rs"},
        json=body,
        timeout=300,
    ) as streamed:
        assert streamed.status_code == 200, streamed.read()
        text = streamed.read().decode()
    events = [
        json.loads(block.split("\ndata: ", 1)[1])
        for block in text.split("\n\n")
        if block.startswith("event: ")
    ]
    names = [e["type"] for e in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["output"] and final["store"] is False
    assert final["usage"]["input_tokens"] > 0 and final["usage"]["output_tokens"] > 0
    # Its function tools are usable: the named one is called with arguments in its schema.
    forced = httpx.post(
        api.stack.base_url + "/v1/responses",
        headers={"Authorization": f"Bearer {api.raw_key}"},
        json={
            **body,
            "stream": False,
            "tool_choice": {"type": "function", "name": "shell"},
            "max_output_tokens": 120,
        },
        timeout=300,
    )
    assert forced.status_code == 200, forced.text
    answer = forced.json()
    [call] = answer["output"]
    assert call["type"] == "function_call" and call["name"] == "shell"
    if answer["status"] == "completed":
        assert isinstance(json.loads(call["arguments"])["command"], list)
    else:  # cut by max_output_tokens inside the arguments, which the grammar held to the schema
        assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
        assert re.match(r'\{\s*"command"\s*:\s*\[', call["arguments"]), call["arguments"]
