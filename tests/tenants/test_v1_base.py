"""Every /v1 route is served by the one base view (core.api.base.ApiView): the same
authentication, request counting, error rendering and x-request-id, whatever the route."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import get_resolver

from core.api.base import ApiView
from inference.api.base import GenerationApi
from tenants.services import tenant_limits_update

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


def test_only_generations_leave_request_counting_to_their_admission():
    counted_elsewhere = {route for route, view in _v1_views().items() if not view.counts_request}
    assert counted_elsewhere == {"v1/chat/completions", "v1/completions"}
    assert all(issubclass(_v1_views()[route], GenerationApi) for route in counted_elsewhere)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/usage", "/v1/adapters"])
def test_every_read_counts_against_the_request_rate(world, path):
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=2)
    client = Client(headers={"Authorization": f"Bearer {world.raw_key_a}"})

    answers = [client.get(path) for _ in range(3)]

    assert [a.status_code for a in answers] == [200, 200, 429]
    assert [a["x-ratelimit-remaining-requests"] for a in answers] == ["1", "0", "0"]
    assert answers[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert int(answers[2]["retry-after"]) >= 1


def test_a_read_refused_for_its_key_is_not_counted(world):
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=1)
    assert Client(headers={"Authorization": "Bearer sk-not-a-key"}).get("/v1/models").status_code == 401
    client = Client(headers={"Authorization": f"Bearer {world.raw_key_a}"})
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
    headers = {"Authorization": f"Bearer {world.raw_key_a}"} if authorized else {}
    response = getattr(Client(headers=headers), method)(path)
    assert response.status_code == status
    assert REQUEST_ID.match(response["x-request-id"])
    assert response["Content-Type"] == "application/json"


def test_request_ids_are_new_for_each_request(world):
    client = Client(headers={"Authorization": f"Bearer {world.raw_key_a}"})
    assert client.get("/v1/models")["x-request-id"] != client.get("/v1/models")["x-request-id"]


def test_a_body_over_the_upload_limit_still_gets_a_request_id(world, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64
    client = Client(headers={"Authorization": f"Bearer {world.raw_key_a}"})
    response = client.post("/v1/completions", {"prompt": "x" * 256}, content_type="application/json")
    assert response.status_code == 413
    assert REQUEST_ID.match(response["x-request-id"])


def test_wrong_method_names_the_allowed_ones(world):
    response = Client(headers={"Authorization": f"Bearer {world.raw_key_a}"}).delete("/v1/usage")
    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD, OPTIONS"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_adapters_upload_must_be_multipart(world):
    client = Client(headers={"Authorization": f"Bearer {world.raw_key_a}"})
    response = client.post("/v1/adapters", {"name": "x"}, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_a_malformed_multipart_body_is_a_400_not_a_crash(world):
    client = Client(headers={"Authorization": f"Bearer {world.raw_key_a}"})
    response = client.generic(
        "POST", "/v1/adapters", b"--x\r\nnot a part", content_type="multipart/form-data; boundary=x"
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
