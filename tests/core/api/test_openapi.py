"""GET /v1/openapi.json: the OpenAPI 3.1 schema of the API, served without a key, valid, and with
an operation for every API route the URL conf serves (a new endpoint without one fails here)."""

from __future__ import annotations

import re

import pytest
import schemathesis
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.drainage import GENERATOR_STATS

from core.api.base import ApiView
from core.api.openapi import AUTH_ERRORS, SECURITY_SCHEME, ApiSchemaGenerator, api_schema

# OpenAPI's name of a path parameter for Django's <converter:name>.
_CONVERTER = re.compile(r"<(?:\w+:)?(\w+)>")


def _routes(patterns, prefix: str = ""):
    """(path as OpenAPI templates it, callback) of every pattern of the URL conf."""
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            yield from _routes(pattern.url_patterns, route)
        elif isinstance(pattern, URLPattern):
            yield "/" + _CONVERTER.sub(r"{\1}", route), pattern.callback


def _api_operations() -> set[tuple[str, str]]:
    """(method, path) of every operation the URL conf serves under /v1, and of /tokenize and
    /detokenize (ApiViews beside /v1); the /v1 catch-all (a regex) is no operation."""
    operations = set()
    for path, callback in _routes(get_resolver().url_patterns):
        view_class = getattr(callback, "view_class", None)
        is_api_view = isinstance(view_class, type) and issubclass(view_class, ApiView)
        if not (is_api_view or path.startswith("/v1/")) or path.startswith("/^"):
            continue
        # A /v1 route that is not an ApiView must be documented all the same: a method it lacks
        # makes the sets differ.
        handlers = (view_class.http_method_names if is_api_view else ["?"]) or []
        for method in handlers:
            if method not in ("options", "head") and (not is_api_view or hasattr(view_class, method)):
                operations.add((method, path))
    return operations


def _schema_operations(schema: dict) -> dict[tuple[str, str], dict]:
    return {(method, path): op for path, ops in schema["paths"].items() for method, op in ops.items()}


def test_the_schema_is_served_as_json_without_a_key():
    response = Client().get("/v1/openapi.json")

    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert body["openapi"] == "3.1.0"
    assert body["info"]["title"] == "Pagoda API"
    assert body == api_schema()


def test_the_catch_all_does_not_shadow_the_schema_and_other_methods_are_refused_in_openai_shape():
    response = Client().post("/v1/openapi.json", "{}", content_type="application/json")

    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD, OPTIONS"
    assert response["x-request-id"]
    assert response.json() == {
        "error": {
            "message": "Method POST is not allowed on /v1/openapi.json.",
            "type": "invalid_request_error",
            "param": None,
            "code": "method_not_allowed",
        }
    }


def test_the_schema_is_a_valid_openapi_3_1_document():
    # Validated against the OpenAPI 3.1 meta-schema; raises with the first violation.
    schemathesis.openapi.from_dict(api_schema()).validate()


def test_the_schema_is_generated_without_a_warning_or_an_error():
    # drf-spectacular's warnings mean a part it could not describe (a field it guessed, two
    # components of one name): each is a lie in the schema.
    ApiSchemaGenerator().get_schema(request=None, public=True)

    assert not GENERATOR_STATS, [*GENERATOR_STATS._warn_cache, *GENERATOR_STATS._error_cache]


def test_every_api_operation_the_urls_route_is_in_the_schema():
    documented = set(_schema_operations(api_schema()))

    assert documented == _api_operations()
    assert {path for _, path in documented} >= {
        "/v1/models",
        "/v1/models/{model}",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/adapters",
        "/v1/adapters/{name}",
        "/v1/usage",
        "/v1/openapi.json",
        "/tokenize",
        "/detokenize",
    }


def test_every_operation_is_described_with_its_own_id_summary_and_responses():
    operations = _schema_operations(api_schema())

    ids = [op["operationId"] for op in operations.values()]
    assert len(set(ids)) == len(ids)
    for (method, path), op in operations.items():
        # Only @extend_schema sets a summary: an operation without one was never described.
        assert op.get("summary"), f"{method.upper()} {path} has no @extend_schema"
        success = [status for status in op["responses"] if status.startswith("2")]
        assert len(success) == 1, (method, path)
        assert op["responses"][success[0]].get("content"), (method, path)


@pytest.mark.parametrize("status", sorted(AUTH_ERRORS))
def test_every_operation_behind_a_key_names_bearer_auth_and_its_errors_in_openai_shape(status):
    schema = api_schema()

    assert schema["components"]["securitySchemes"][SECURITY_SCHEME] == {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key of your organization: `Authorization: Bearer sk-...`.",
    }
    assert schema["components"]["schemas"]["ErrorDetail"]["required"] == ["code", "message", "param", "type"]
    for (method, path), op in _schema_operations(schema).items():
        if path == "/v1/openapi.json":
            assert "security" not in op and set(op["responses"]) == {"200"}
            continue
        assert op["security"] == [{SECURITY_SCHEME: []}], (method, path)
        # Anthropic's Messages API answers in Anthropic's shape, its 503 being a 529.
        anthropic = path.startswith("/v1/messages")
        code = 529 if anthropic and status == 503 else status
        error = op["responses"][str(code)]["content"]["application/json"]["schema"]
        shape = "AnthropicError" if anthropic else "Error"
        assert error == {"$ref": f"#/components/schemas/{shape}"}, (method, path)


def test_generation_answers_json_or_server_sent_events():
    paths = api_schema()["paths"]

    for path, component in [("/v1/chat/completions", "ChatCompletion"), ("/v1/completions", "Completion")]:
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{component}"}
        event = content["text/event-stream"]["schema"]
        assert event["properties"]["data"]["type"] == "string" and event["required"] == ["data"]
        request = paths[path]["post"]["requestBody"]["content"]
        assert list(request) == ["application/json"]


def test_adapters_are_uploaded_as_multipart_files():
    schema = api_schema()

    request = schema["paths"]["/v1/adapters"]["post"]["requestBody"]["content"]
    assert list(request) == ["multipart/form-data"]
    form = schema["components"]["schemas"]["CreateAdapterRequest"]
    assert form["properties"]["file"]["items"] == {"type": "string", "format": "binary"}
    assert set(form["required"]) == {"name", "base_model", "file"}
