"""The Responses API without a model: a body read into the chat body it asks for
(inference.api.openai_responses.translate), what the chat format cannot carry refused with the
Responses field's name, and the stored responses (inference.services.stored_responses): chains,
pages of input items, expiry, the per-tenant bound, and another tenant's ids as 404s."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client, override_settings
from django.utils import timezone

from core.errors import InvalidRequestError, NotFoundError
from inference.api.openai_responses.render import ResponseStream, assistant_message, whole_output
from inference.api.openai_responses.translate import chat_messages, response_input
from inference.models import StoredResponse
from inference.services import ChoiceDelta, ChoiceFinished, GenerationPlan
from inference.services import stored_responses as store
from tests.helpers import logged_in
from tests.inference.conftest import queued_requests

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def _messages(body: dict, earlier: list | None = None) -> list[dict]:
    read = response_input(body)
    return chat_messages(read, earlier or [], read.echo.get("instructions"))


def test_input_items_become_the_chat_messages_of_a_tool_round_trip() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Looking."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "21C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "25C"}],
            },
        ],
        "tools": [WEATHER],
    }
    messages = _messages(body)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21C"},
        {"role": "tool", "tool_call_id": "c2", "content": "25C"},
    ]
    read = response_input(body)
    # Listed as sent, reasoning aside, each with an id; instructions are not an input item.
    assert [item["type"] for item in read.items] == [
        "message",
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
    ]
    assert all(item["id"] for item in read.items) and read.items[2]["content"][0]["type"] == "output_text"
    assert read.chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather.",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]


def test_the_earlier_turns_come_between_the_instructions_and_the_input() -> None:
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    messages = _messages({"model": "m", "instructions": "New rules.", "input": "Again?"}, earlier)
    assert messages == [
        {"role": "system", "content": "New rules."},
        *earlier,
        {"role": "user", "content": "Again?"},
    ]


@pytest.mark.parametrize("probe", ["", [], None])
def test_an_empty_probe_asks_an_empty_user_message(probe) -> None:
    body = {"model": "m", "max_output_tokens": 1} | ({} if probe is None else {"input": probe})
    assert _messages(body)[-1] == {"role": "user", "content": ""}


def test_fields_map_onto_the_chat_fields() -> None:
    read = response_input(
        {
            "model": "m",
            "input": "x",
            "max_output_tokens": 50,
            "temperature": 0.2,
            "top_p": 0.9,
            "stream": True,
            "metadata": {"k": "v"},
            "safety_identifier": "u1",
            "prompt_cache_key": "conv-1",
            "service_tier": "flex",
            "parallel_tool_calls": False,
            "text": {
                "format": {"type": "json_schema", "name": "cap", "schema": {"type": "object"}, "strict": True}
            },
            "reasoning": {"effort": "low"},
            "include": ["reasoning.encrypted_content"],
            "client_metadata": {"a": "b"},
            "store": False,
        }
    )
    assert read.chat == {
        "model": "m",
        "temperature": 0.2,
        "top_p": 0.9,
        "stream": True,
        "parallel_tool_calls": False,
        "service_tier": "flex",
        "metadata": {"k": "v"},
        "max_completion_tokens": 50,
        "safety_identifier": "u1",
        "prompt_cache_key": "conv-1",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "cap", "schema": {"type": "object"}, "strict": True},
        },
    }
    assert read.store is False and read.echo["reasoning"] == {"effort": "low"}
    assert response_input({"model": "m", "text": {"format": {"type": "json_object"}}}).chat[
        "response_format"
    ] == {"type": "json_object"}
    assert "response_format" not in response_input({"model": "m", "text": {"format": {"type": "text"}}}).chat


def test_hosted_and_custom_tools_are_left_out_and_tool_choice_follows_what_is_left() -> None:
    tools = [{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}, {"type": "file_search"}]
    read = response_input({"model": "m", "tools": tools, "tool_choice": "auto"})
    assert "tools" not in read.chat and read.chat["tool_choice"] == "none"
    read = response_input({"model": "m", "tools": [*tools, WEATHER], "tool_choice": "required"})
    assert [t["function"]["name"] for t in read.chat["tools"]] == ["get_weather"]
    assert read.chat["tool_choice"] == "required"
    named = response_input(
        {"model": "m", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    )
    assert named.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    other = {**WEATHER, "name": "get_time"}
    allowed = response_input(
        {
            "model": "m",
            "tools": [WEATHER, other],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_time"}],
            },
        }
    )
    assert [t["function"]["name"] for t in allowed.chat["tools"]] == ["get_time"]
    assert allowed.chat["tool_choice"] == "required"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"background": True}, "background", "background responses are not supported"),
        ({"truncation": "auto"}, "truncation", "only disabled"),
        ({"conversation": "conv_1"}, "conversation", "Extra inputs"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "item references"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0.type", "not supported"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}
                ]
            },
            "input.0.content.0",
            "input_image parts are not supported",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "must be one of"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0", "call_id and a name"),
        ({"tools": [{"type": "brand_new_tool"}]}, "tools.0.type", "not supported"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
            "nope",
        ),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema", "JSON schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "text, json_object or json_schema"),
        ({"previous_response_id": 5}, "previous_response_id", "response id"),
        ({"instructions": ["x"]}, "instructions", "must be a string"),
    ],
)
def test_what_cannot_be_carried_is_refused_by_its_field(body: dict, param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as refused:
        response_input({"model": "m", **body})
    assert refused.value.param == param


# Stored responses.


def _save(tenant, response_id: str, previous=None, *, messages=None, items=None) -> store.ResponseTurn:
    store.stored_response_save(
        tenant_id=tenant.id,
        body={"id": response_id, "model": "m", "output": []},
        input_items=items or [],
        messages=messages or [{"role": "user", "content": response_id}],
        previous=previous,
    )
    return store.stored_response_turn(tenant_id=tenant.id, response_id=response_id)


@pytest.mark.django_db
def test_a_chain_is_read_oldest_first_and_a_gap_in_it_is_refused(world) -> None:
    one = _save(world.tenant_a, "resp_1")
    two = _save(world.tenant_a, "resp_2", one)
    _save(world.tenant_a, "resp_2b", one)  # a branch from the same turn
    three = _save(world.tenant_a, "resp_3", two)
    assert (three.root_id, three.depth) == ("resp_1", 2)
    assert [m["content"] for m in three.messages] == ["resp_1", "resp_2", "resp_3"]
    branch = store.stored_response_turn(tenant_id=world.tenant_a.id, response_id="resp_2b")
    assert [m["content"] for m in branch.messages] == ["resp_1", "resp_2b"]
    store.stored_response_delete(tenant_id=world.tenant_a.id, response_id="resp_2")
    with pytest.raises(InvalidRequestError) as gap:
        store.stored_response_turn(tenant_id=world.tenant_a.id, response_id="resp_3")
    assert gap.value.code == "previous_response_not_found" and gap.value.param == "previous_response_id"


@pytest.mark.django_db
def test_another_tenants_and_expired_responses_are_not_found(world) -> None:
    _save(world.tenant_a, "resp_a")
    for call in (
        lambda: store.stored_response_get(tenant_id=world.tenant_b.id, response_id="resp_a"),
        lambda: store.stored_response_turn(tenant_id=world.tenant_b.id, response_id="resp_a"),
        lambda: store.stored_response_delete(tenant_id=world.tenant_b.id, response_id="resp_a"),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert store.stored_response_get(tenant_id=world.tenant_a.id, response_id="resp_a").id == "resp_a"
    StoredResponse.objects.filter(id="resp_a").update(expires_at=timezone.now() - timedelta(seconds=1))
    _save(world.tenant_a, "resp_live")
    with pytest.raises(NotFoundError):
        store.stored_response_get(tenant_id=world.tenant_a.id, response_id="resp_a")
    assert store.stored_responses_expire() == 1
    assert list(StoredResponse.objects.values_list("id", flat=True)) == ["resp_live"]


@pytest.mark.django_db
def test_stored_responses_expire_after_the_configured_days(world) -> None:
    with override_settings(RESPONSES_TTL_DAYS=7):
        _save(world.tenant_a, "resp_week")
    row = StoredResponse.objects.get(id="resp_week")
    assert row.expires_at - row.created_at == timedelta(days=7)


@pytest.mark.django_db
def test_input_items_are_listed_in_pages(world) -> None:
    items = [{"type": "message", "id": f"msg_{i}", "role": "user", "content": []} for i in range(5)]
    _save(world.tenant_a, "resp_items", items=items)

    def page(**kwargs):
        found, more = store.stored_response_input_items(
            tenant_id=world.tenant_a.id, response_id="resp_items", **kwargs
        )
        return [item["id"] for item in found], more

    assert page(limit=2, order="desc", after=None) == (["msg_4", "msg_3"], True)
    assert page(limit=2, order="desc", after="msg_3") == (["msg_2", "msg_1"], True)
    assert page(limit=2, order="asc", after="msg_2") == (["msg_3", "msg_4"], False)
    with pytest.raises(InvalidRequestError):
        page(limit=2, order="asc", after="msg_9")


@pytest.mark.django_db(transaction=True)
async def test_a_tenant_over_its_storage_bound_is_refused_before_anything_is_queued(world) -> None:
    from asgiref.sync import sync_to_async

    await sync_to_async(_save)(world.tenant_a, "resp_big", messages=[{"role": "user", "content": "x" * 4000}])
    used = await sync_to_async(store.stored_bytes)(tenant_id=world.tenant_a.id)
    client = Client(headers=world.headers())

    def post(body: dict):
        return client.post("/v1/responses", json.dumps(body), content_type="application/json")

    with override_settings(RESPONSES_STORAGE_PER_TENANT=used):
        refused = await sync_to_async(post)({"model": world.model, "input": "Hi", "max_output_tokens": 4})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "response_storage_quota" and error["param"] == "store"
    assert str(used) in error["message"]
    assert await queued_requests(world.model) == []


@pytest.mark.django_db
def test_the_stored_response_views_keep_tenants_apart(world) -> None:
    _save(
        world.tenant_a,
        "resp_views",
        items=[{"type": "message", "id": "msg_1", "role": "user", "content": []}],
    )
    mine, theirs = Client(headers=world.headers()), Client(headers=world.headers(world.raw_key_b))
    assert mine.get("/v1/responses/resp_views").json()["id"] == "resp_views"
    listed = mine.get("/v1/responses/resp_views/input_items").json()
    assert listed == {
        "object": "list",
        "data": listed["data"],
        "first_id": "msg_1",
        "last_id": "msg_1",
        "has_more": False,
    }
    for response in (
        theirs.get("/v1/responses/resp_views"),
        theirs.get("/v1/responses/resp_views/input_items"),
        theirs.delete("/v1/responses/resp_views"),
    ):
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert mine.get("/v1/responses/resp_views/input_items?limit=0").json()["error"]["param"] == "limit"
    assert mine.get("/v1/responses/resp_views/input_items?order=up").json()["error"]["param"] == "order"
    assert mine.delete("/v1/responses/resp_views").json() == {
        "id": "resp_views",
        "object": "response",
        "deleted": True,
    }
    assert mine.get("/v1/responses/resp_views").status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"tool_choice": {"type": {}, "name": ""}},
        {
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": {}}],
            }
        },
        {"tools": [{"type": []}]},
        {"input": [{"type": {}}]},
        {"input": [{"role": "user", "content": [{"type": {"a": 1}}]}]},
        {"text": {"format": {"type": ["json_object"]}}},
    ],
)
def test_objects_where_names_belong_are_refused_not_crashed_on(body: dict) -> None:
    try:
        response_input({"model": "m", **body})
    except InvalidRequestError as refused:
        assert refused.param


# The renderer: a whole response and its stream give the same output items.


def _reasoning_plan() -> GenerationPlan:
    return GenerationPlan(
        kind="chat",
        request_id="r1",
        model="m",
        model_path="unused",
        max_model_len=1 << 20,
        prompts=[[1]],
        n=1,
        max_tokens=64,
        sampling_params={},
        reasoning_parser="qwen3",
        tool_mode="auto",
        tool_parser="hermes",
    )


THOUGHT_AND_CALL = (
    "<think>The user wants the weather.</think>\n\nLet me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_reasoning_text_and_calls_stream_into_the_items_of_the_whole_response(piece: int) -> None:
    plan = _reasoning_plan()
    whole, status = whole_output(plan, THOUGHT_AND_CALL, "stop")
    assert status == "completed"
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "The user wants the weather."}]
    assert whole[1]["content"][0]["text"] == "Let me check."
    assert whole[2]["name"] == "get_weather" and json.loads(whole[2]["arguments"]) == {"city": "Paris"}

    stream = ResponseStream(plan)
    events = []
    for start in range(0, len(THOUGHT_AND_CALL), piece):
        events += stream.feed(
            ChoiceDelta(index=0, text=THOUGHT_AND_CALL[start : start + piece], token_ids=[])
        )
    events += stream.feed(ChoiceFinished(index=0, finish_reason="stop"))
    events += stream.close()
    # The items as streamed equal the whole ones, but for the call ids the parser makes up.
    assert [{**item, "call_id": None} for item in stream.output] == [
        {**item, "call_id": None} for item in whole
    ]
    names = [name for name, _ in events]
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == 3
    added = [body["output_index"] for name, body in events if name == "response.output_item.added"]
    assert added == [0, 1, 2]
    reasoning = "".join(b["delta"] for n, b in events if n == "response.reasoning_text.delta")
    text = "".join(b["delta"] for n, b in events if n == "response.output_text.delta")
    arguments = "".join(b["delta"] for n, b in events if n == "response.function_call_arguments.delta")
    assert (reasoning, text, json.loads(arguments)) == (
        "The user wants the weather.",
        "Let me check.",
        {"city": "Paris"},
    )
    # Each item closes before the next opens.
    assert names.index("response.output_item.done") < names.index("response.output_item.added", 1)


def test_a_cut_answer_is_incomplete_and_the_next_turn_repeats_its_text_and_calls() -> None:
    plan = _reasoning_plan()
    output, status = whole_output(plan, "<think>Hmm", "length")
    assert status == "incomplete" and [item["type"] for item in output] == ["reasoning"]
    full, _ = whole_output(plan, THOUGHT_AND_CALL, "stop")
    message = assistant_message(full)
    assert (
        message["content"] == "Let me check."
        and message["tool_calls"][0]["function"]["name"] == "get_weather"
    )
    assert "reasoning" not in json.dumps(message)


@pytest.mark.django_db
def test_operators_see_and_delete_stored_responses_in_the_admin(world) -> None:
    _save(world.tenant_a, "resp_admin", messages=[{"role": "user", "content": "a question for the admin"}])
    operator = get_user_model().objects.create_superuser(
        "operator", "operator@example.com", "operator-pass-1"
    )
    client = logged_in(operator)
    listed = client.get("/admin/inference/storedresponse/")
    assert listed.status_code == 200 and "resp_admin" in listed.content.decode()
    page = client.get("/admin/inference/storedresponse/resp_admin/change/")
    assert page.status_code == 200 and "a question for the admin" in page.content.decode()
    assert client.get("/admin/inference/storedresponse/add/").status_code == 403
    client.post("/admin/inference/storedresponse/resp_admin/delete/", {"post": "yes"})
    assert not StoredResponse.objects.filter(id="resp_admin").exists()
