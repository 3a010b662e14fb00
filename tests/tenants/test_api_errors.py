"""Every /v1 error is OpenAI's {"error": {"message", "type", "param", "code"}} with a string code:
never an HTML page, never a 500 for bad input, whatever the route, method or body."""

from __future__ import annotations

import importlib
import json

import pytest
from django.test import Client

from tests.helpers import MODEL

pytestmark = pytest.mark.django_db

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _assert_openai_error(response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"] == "application/json"
    body = json.loads(response.content)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["code"], str)
    assert (error["code"], error["param"]) == (code, param)
    return error


@pytest.fixture
def client(world) -> Client:
    return Client(headers=world.headers())


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/v1"),
        ("get", "/v1/"),
        ("get", "/v1/nope"),
        ("post", "/v1/nope"),
        ("delete", "/v1/vector_stores/vs-123"),
        ("get", "/v1/usage/"),  # a trailing slash is another route, answered in place (no redirect)
        ("post", "/v1/chat/completions/"),
        ("post", "/v1/audio/speech"),
    ],
)
def test_unknown_routes_are_404_in_openai_shape(client, method, path):
    error = _assert_openai_error(getattr(client, method)(path), 404, "unknown_url")
    assert path in error["message"]


def test_unknown_route_without_a_key_is_still_json(db):
    _assert_openai_error(Client().get("/v1/nope"), 404, "unknown_url")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/v1/usage"),
        ("delete", "/v1/usage"),
        ("post", "/v1/models"),
        ("get", CHAT),
        ("put", "/v1/completions"),
        ("patch", CHAT),
    ],
)
def test_wrong_methods_are_405_in_openai_shape(client, method, path):
    _assert_openai_error(getattr(client, method)(path), 405, "method_not_allowed")


@pytest.mark.parametrize("path", ["/v1/usage", "/v1/models"])
@pytest.mark.parametrize(
    "authorization", [None, "", "Bearer", "Basic dXNlcjpwYXNz", "Bearer sk-not-a-key", "Bearer " + "x" * 5000]
)
def test_missing_or_malformed_keys_are_401_in_openai_shape(db, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    response = Client(headers=headers).get(path)
    _assert_openai_error(response, 401, "invalid_api_key")
    assert response["WWW-Authenticate"] == 'Bearer realm="api"'


@pytest.mark.parametrize(
    ("body", "content_type", "code"),
    [
        (b"{not json", "application/json", "invalid_json"),
        (b'{"model": "m", "messages": [', "application/json", "invalid_json"),
        (b"\xff\xfe\xfa", "application/json", "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "invalid_json"),
        (b"", "application/json", "invalid_request_error"),
        (b"null", "application/json", "invalid_request_error"),
        (b"[1, 2]", "application/json", "invalid_request_error"),
        (b'"a string"', "application/json", "invalid_request_error"),
        (b"model=m", "application/x-www-form-urlencoded", "invalid_request_error"),
        (b"hello", "text/plain", "invalid_request_error"),
    ],
)
def test_bodies_that_are_not_a_json_object_are_400(client, body, content_type, code):
    _assert_openai_error(client.generic("POST", CHAT, body, content_type=content_type), 400, code)


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"model": ["a"]}, "model", "invalid"),
        ({"messages": "Hi"}, "messages", "invalid"),
        ({"messages": [{"role": 5, "content": "Hi"}]}, "messages", "invalid"),
        ({"messages": ["Hi"]}, "messages", "invalid"),
        ({"max_tokens": "ten"}, "max_tokens", "invalid"),
        ({"max_tokens": True}, "max_tokens", "invalid"),
        ({"max_tokens": -1}, "max_tokens", "min_value"),
        ({"temperature": "hot"}, "temperature", "invalid"),
        ({"temperature": {"x": 1}}, "temperature", "invalid"),
        ({"n": 2.5}, "n", "invalid"),
        ({"stop": 7}, "stop", "invalid"),
        ({"stream": "yes please"}, "stream", "invalid"),
        ({"seed": [1]}, "seed", "invalid"),
    ],
)
def test_wrong_types_are_400_naming_the_param(client, fields, param, code):
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    response = client.post(CHAT, json.dumps(body), content_type="application/json")
    error = _assert_openai_error(response, 400, code, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"store": True}, "store", "invalid"),
        ({"safety_identifier": "x" * 65}, "safety_identifier", "max_length"),
        ({"prompt_cache_key": "x" * 65}, "prompt_cache_key", "max_length"),
        ({"user": ["a"]}, "user", "invalid"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k", "max_length"),
        ({"metadata": "tag"}, "metadata", "not_a_dict"),
    ],
)
def test_sdk_fields_out_of_their_bounds_are_400_naming_the_field(client, fields, param, code):
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    response = client.post(CHAT, json.dumps(body), content_type="application/json")
    _assert_openai_error(response, 400, code, param)


@pytest.mark.parametrize("name", ["frobnicate", "cache_salt", "Model"])
def test_unknown_fields_are_400_naming_the_field(client, name):
    body = {"model": MODEL, "messages": MESSAGES, name: 1}
    response = client.post(CHAT, json.dumps(body), content_type="application/json")
    error = _assert_openai_error(response, 400, "unknown_parameter", name)
    assert error["message"] == f"Unrecognized request argument supplied: {name}"


def test_not_a_number_is_refused_not_a_crash(client):
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": 0.5}).replace("0.5", "NaN")
    response = client.post(CHAT, body, content_type="application/json")
    _assert_openai_error(response, 400, "invalid", "temperature")


def test_a_model_nobody_serves_is_404_model_not_found(client):
    body = {"model": "no-such-model", "messages": MESSAGES}
    response = client.post(CHAT, json.dumps(body), content_type="application/json")
    _assert_openai_error(response, 404, "model_not_found", "model")


def test_a_body_over_the_upload_limit_is_413_json_not_an_html_page(client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}]}
    response = client.post(CHAT, json.dumps(body), content_type="application/json")
    error = _assert_openai_error(response, 413, "request_too_large")
    assert "1024 bytes" in error["message"]


def test_a_host_outside_allowed_hosts_gets_json_on_v1(world):
    response = Client(headers=world.headers()).get("/v1/usage", HTTP_HOST="evil.example")
    _assert_openai_error(response, 400, "invalid_request_error")


def test_pages_outside_v1_keep_their_html_errors(db):
    response = Client().get("/dashboard/no-such-page/")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(
    ("module", "selector", "path"),
    [
        ("inference.api.views", "deployment_list_for_caller", "/v1/models"),  # an async view
        ("tenants.api.views", "usage_summary", "/v1/usage"),  # a sync view
    ],
    ids=["async-view", "sync-view"],
)
def test_a_crash_inside_a_view_is_a_json_500_not_an_html_page(client, monkeypatch, module, selector, path):
    def broken(**kwargs):
        raise RuntimeError("a bug, not bad input")

    monkeypatch.setattr(importlib.import_module(module), selector, broken)

    response = client.get(path)

    _assert_openai_error(response, 500, "internal_error")
    assert "a bug" not in response.content.decode()
