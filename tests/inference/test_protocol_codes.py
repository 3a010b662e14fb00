"""The wire contract's codes (engine.protocol's FinishReason and ErrorCode) are mapped by the web
tier, every member: a new member without a mapping fails here, not in a client's hands."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from core.errors import InvalidRequestError, PlatformError, ServiceUnavailableError
from engine.protocol import ErrorCode, Event, FinishReason
from inference.services import generation

ROOT = Path(__file__).resolve().parents[2]


def test_every_finish_reason_has_a_mapping():
    assert set(generation.FINISH_REASONS) == set(FinishReason)
    assert {generation.FINISH_REASONS[r] for r in (FinishReason.STOP, FinishReason.LENGTH)} == {
        "stop",
        "length",
    }


def test_every_engine_error_code_has_a_mapping():
    assert set(generation.ENGINE_ERROR_KINDS) == set(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_engine_error_code_becomes_the_error_its_kind_says(code):
    error = generation._engine_error(Event.error("detail", code))
    kind = generation.ENGINE_ERROR_KINDS[code]
    expected = {"client": InvalidRequestError, "dropped": ServiceUnavailableError, "server": PlatformError}[
        kind
    ]
    assert type(error) is expected
    assert (error.code, error.status_code) == (
        code.value,
        {"client": 400, "dropped": 503, "server": 500}[kind],
    )


def test_a_code_of_a_newer_engine_is_the_platforms_failure_with_its_code():
    error = generation._engine_error(Event.error("detail", "something_new"))
    assert (type(error), error.code) == (PlatformError, "something_new")


def test_the_engine_names_no_code_or_finish_reason_by_a_bare_string():
    """Codes and finish reasons are members wherever the engine sets them."""
    literals = {member.value for member in (*ErrorCode, *FinishReason)}
    found = []
    for path in (ROOT / "engine").rglob("*.py"):
        if path.name == "protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg in ("code", "finish_reason", "error_code"):
                value = node.value
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr in ("code", "finish_reason", "error_code")
                for t in node.targets
            ):
                value = node.value
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
                "error",
                "_finish_completion",
                "finish",
            ):
                found.extend(
                    f"{path.relative_to(ROOT)}:{node.lineno}"
                    for arg in node.args
                    if isinstance(arg, ast.Constant) and arg.value in literals
                )
                continue
            else:
                continue
            if isinstance(value, ast.Constant) and value.value in literals:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
