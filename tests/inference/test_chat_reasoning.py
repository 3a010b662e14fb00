"""A deployment's reasoning parser on /v1/chat/completions: the thinking comes back as
`reasoning_content`, apart from the answer, whole and streamed; and `chat_template_kwargs`.

The tiny model cannot think, so a regex (structured outputs) makes it write a Qwen3-shaped answer,
greedy: `<think>words</think>`, a blank line, then a sentence."""

from __future__ import annotations

import json
import re

import pytest
from asgiref.sync import sync_to_async

from tests.helpers import api_post, sse_events
from tests.inference.test_chat_api import chat_body

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/chat/completions"
SHAPE = r"<think>[a-z]{2,5}( [a-z]{2,5}){1,2}</think>\n\n[A-Z][a-z]{2,6}\."


def _thinking_body(world, **extra) -> dict:
    return chat_body(
        world,
        "Think, then answer.",
        max_tokens=64,
        temperature=0,
        structured_outputs={"regex": SHAPE},
        **extra,
    )


async def _parser(world, name: str) -> None:
    world.deployment.reasoning_parser = name
    await sync_to_async(world.deployment.save)(update_fields=["reasoning_parser"])


async def test_the_thinking_comes_back_as_reasoning_content_apart_from_the_answer(world, engine_worker):
    raw = (await api_post(world, URL, _thinking_body(world))).json()["choices"][0]["message"]
    assert re.fullmatch(SHAPE, raw["content"]) and "reasoning_content" not in raw  # no parser: all content

    await _parser(world, "qwen3")
    response = await api_post(world, URL, _thinking_body(world))

    assert response.status_code == 200
    choice = response.json()["choices"][0]
    thought, answer = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", raw["content"]).groups()
    assert choice["message"] == {
        "role": "assistant",
        "content": answer,
        "reasoning_content": thought,
        "refusal": None,
    }
    assert choice["finish_reason"] == "stop"


async def test_streamed_reasoning_and_content_deltas_join_to_the_whole_answers_parts(world, engine_worker):
    await _parser(world, "qwen3")
    whole = (await api_post(world, URL, _thinking_body(world))).json()["choices"][0]["message"]

    response = await api_post(world, URL, _thinking_body(world, stream=True))

    events = sse_events(b"".join([chunk async for chunk in response.streaming_content]))
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[1:-1]]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if "content" in d]
    assert len(reasoning) >= 2 and all(reasoning) and all(content)  # streamed as it came, never empty
    assert "".join(reasoning) == whole["reasoning_content"]
    assert "".join(content) == whole["content"]
    assert not any("<think>" in piece or "</think>" in piece for piece in reasoning + content)


async def test_an_answer_without_thinking_is_all_content(world, engine_worker):
    await _parser(world, "qwen3")
    body = chat_body(
        world, "Answer.", max_tokens=8, temperature=0, structured_outputs={"regex": "[A-Z][a-z]{3}\\."}
    )
    message = (await api_post(world, URL, body)).json()["choices"][0]["message"]
    assert re.fullmatch(r"[A-Z][a-z]{3}\.", message["content"]) and message["reasoning_content"] is None


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"enable_thinking": False}, 200),
        ({"enable_thinking": "no"}, 400),  # text would reach the prompt unchecked
        ({"add_generation_prompt": False}, 400),  # the platform's own variable
        ({"bos_token": 1}, 400),
        ({f"v{i}": 1 for i in range(17)}, 400),
    ],
)
async def test_chat_template_kwargs_take_booleans_and_numbers_of_the_templates_own(
    world, engine_worker, kwargs, status
):
    response = await api_post(world, URL, chat_body(world, max_tokens=2, chat_template_kwargs=kwargs))
    assert response.status_code == status, response.content
    if status == 400:
        assert response.json()["error"]["param"] == "chat_template_kwargs"
