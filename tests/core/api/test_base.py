"""Every /v1 route is served by the one base view (core.api.base.ApiView): the same
authentication, request counting, error rendering and x-request-id, whatever the route."""

from __future__ import annotations

import json
import re
import threading

import pytest
from django.test import Client
from django.urls import get_resolver

from core.api.base import ApiView
from tenants.services import tenant_limits_update
from tests.helpers import MODEL

pytestmark = pytest.mark.django_db

REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")


def _v1_views() -> dict[str, type]:
    """Every /v1 route (the catch-all aside) and the view class serving it."""
    views: dict[str, type] = {}

    def walk(patterns, prefix: str) -> None:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if hasattr(pattern, "url_patterns"):
                walk(pattern.url_patterns, route)
            elif route.startswith("v1/"):
                views[route] = getattr(pattern.callback, "view_class", None)

    walk(get_resolver().url_patterns, "")
    return views


def test_every_v1_route_is_an_api_view():
    views = _v1_views()
    assert {"v1/models", "v1/usage", "v1/adapters", "v1/chat/completions", "v1/completions"} <= set(views)
    for route, view in views.items():
        assert view is not None and issubclass(view, ApiView), route


def test_every_v1_view_but_the_documentation_asks_for_a_key_and_counts_the_request_before_reading_it():
    views = _v1_views()
    assert [route for route, view in views.items() if view.public] == ["v1/openapi.json"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/usage", "/v1/adapters"])
def test_every_read_counts_against_the_request_rate(world, path):
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=2)
    client = Client(headers=world.headers())

    answers = [client.get(path) for _ in range(3)]

    assert [a.status_code for a in answers] == [200, 200, 429]
    assert [a["x-ratelimit-remaining-requests"] for a in answers] == ["1", "0", "0"]
    assert answers[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert int(answers[2]["retry-after"]) >= 1


def test_a_read_refused_for_its_key_is_not_counted(world):
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=1)
    assert Client(headers={"Authorization": "Bearer sk-not-a-key"}).get("/v1/models").status_code == 401
    client = Client(headers=world.headers())
    assert client.get("/v1/models").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "authorized", "status"),
    [
        ("get", "/v1/models", True, 200),
        ("get", "/v1/usage", True, 200),
        ("get", "/v1/adapters", True, 200),
        ("get", "/v1/adapters/nope", True, 404),
        ("delete", "/v1/adapters/nope", True, 404),
        ("get", "/v1/models", False, 401),
        ("get", "/v1/usage", False, 401),
        ("post", "/v1/chat/completions", False, 401),
        ("post", "/v1/completions", True, 400),
        ("post", "/v1/models", True, 405),
        ("get", "/v1/nope", True, 404),
        ("get", "/v1", False, 404),
    ],
)
def test_every_v1_answer_carries_a_request_id(world, method, path, authorized, status):
    headers = world.headers() if authorized else {}
    response = getattr(Client(headers=headers), method)(path)
    assert response.status_code == status
    assert REQUEST_ID.match(response["x-request-id"])
    assert response["Content-Type"] == "application/json"


def test_request_ids_are_new_for_each_request(world):
    client = Client(headers=world.headers())
    assert client.get("/v1/models")["x-request-id"] != client.get("/v1/models")["x-request-id"]


def test_a_body_over_the_upload_limit_still_gets_a_request_id(world, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64
    client = Client(headers=world.headers())
    response = client.post("/v1/completions", {"prompt": "x" * 256}, content_type="application/json")
    assert response.status_code == 413
    assert REQUEST_ID.match(response["x-request-id"])


def test_wrong_method_names_the_allowed_ones(world):
    response = Client(headers=world.headers()).delete("/v1/usage")
    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD, OPTIONS"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_adapters_upload_must_be_multipart(world):
    client = Client(headers=world.headers())
    response = client.post("/v1/adapters", {"name": "x"}, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_a_malformed_multipart_body_is_a_400_not_a_crash(world):
    client = Client(headers=world.headers())
    response = client.generic(
        "POST", "/v1/adapters", b"--x\r\nnot a part", content_type="multipart/form-data; boundary=x"
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}).encode(),
        json.dumps({"model": MODEL, "messages": "Hi"}).encode(),
    ],
    ids=["not-json", "unknown-model", "bad-field"],
)
def test_refused_generations_count_against_the_request_rate(world, body):
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=2)
    client = Client(headers=world.headers())

    answers = [client.generic("POST", "/v1/chat/completions", body, content_type="application/json")]
    answers.append(client.get("/v1/models"))
    answers.append(client.generic("POST", "/v1/chat/completions", body, content_type="application/json"))

    assert answers[0].status_code in (400, 404)
    assert [a.status_code for a in answers[1:]] == [200, 429]


def test_a_tenant_over_its_rate_costs_no_tokenization(world, monkeypatch):
    from inference import tokenization

    tokenized = []
    monkeypatch.setattr(tokenization, "chat_prompt_ids", lambda *a, **k: tokenized.append(a) or [1, 2, 3])
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=1)
    client = Client(headers=world.headers())
    assert client.get("/v1/models").status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}

    response = client.post("/v1/chat/completions", body, content_type="application/json")

    assert response.status_code == 429
    assert tokenized == []


class _Held(ApiView):
    """A public view whose sync handler waits until the test lets it go."""

    public = True
    handler_in_pool = True
    entered = None  # threading.Event
    release = None  # threading.Event

    def get(self, request):
        self.entered.set()
        assert self.release.wait(60)
        return {"held": True}


class _Quick(ApiView):
    public = True

    def get(self, request):
        return {"quick": True}


async def test_a_handler_in_the_pool_does_not_hold_up_other_requests_sync_work():
    # Given a sync handler whose work grows with its body (handler_in_pool) and is running long
    import asyncio
    import threading

    from django.test import AsyncRequestFactory

    _Held.entered, _Held.release = threading.Event(), threading.Event()
    factory = AsyncRequestFactory()
    held = asyncio.ensure_future(_Held.as_view()(factory.get("/v1/held")))
    try:
        assert await asyncio.to_thread(_Held.entered.wait, 60)
        # When another request's sync handler runs on Django's shared thread meanwhile
        quick = await asyncio.wait_for(_Quick.as_view()(factory.get("/v1/quick")), timeout=30)
        # Then it is answered while the first still works
        assert quick.status_code == 200 and json.loads(quick.content) == {"quick": True}
        assert not held.done()
    finally:
        _Held.release.set()
    assert json.loads((await held).content) == {"held": True}


def test_the_tokenizer_views_run_their_work_in_the_pool():
    from inference.api.tokens import DetokenizeApi, TokenizeApi

    assert TokenizeApi.handler_in_pool and DetokenizeApi.handler_in_pool


def test_an_input_serializer_is_made_once_per_thread_and_keeps_nothing_between_bodies():
    """validated() uses one instance of a serializer class per thread (making one deep-copies its
    fields): each body still gets its own answer, defaults included, and an error in one body
    leaves nothing behind for the next, in every thread."""
    from concurrent.futures import ThreadPoolExecutor

    from core.api.base import validated
    from core.errors import InvalidRequestError
    from inference.api.chat_completions.schema import ChatCompletionInputSerializer

    made: list[int] = []

    class Counted(ChatCompletionInputSerializer):
        def get_fields(self):
            made.append(threading.get_ident())
            return super().get_fields()

    def check(i: int) -> None:
        messages = [{"role": "user", "content": f"question {i}"}]
        full = validated(
            Counted, {"model": "m", "messages": messages, "max_tokens": i + 1, "temperature": 0.5}
        )
        assert (full["max_tokens"], full["temperature"], full["messages"][0]["content"]) == (
            i + 1,
            0.5,
            f"question {i}",
        )
        bare = validated(Counted, {"model": "m", "messages": messages})
        assert "max_tokens" not in bare and "temperature" not in bare  # nothing kept from the body before
        with pytest.raises(InvalidRequestError) as refused:
            validated(Counted, {"model": "m", "messages": messages, "max_tokens": -1})
        assert refused.value.param == "max_tokens"
        with pytest.raises(InvalidRequestError) as unknown:
            validated(Counted, {"model": "m", "messages": messages, "colour": "red"})
        assert unknown.value.param == "colour"
        assert validated(Counted, {"model": "m", "messages": messages, "max_tokens": 3})["max_tokens"] == 3

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(check, range(64)))
    check(64)
    assert len(made) == len(set(made))  # once per thread that validated, not once per body
