"""The `structured_outputs` of a request, with vLLM's field names, checked and made canonical.

Exactly one constraint: `json` (a JSON schema, as an object or its text), `regex`, `choice` (a
list of strings), `grammar` (xgrammar's EBNF) or `json_object` (any JSON object). One option:
`disable_any_whitespace` (default true here, unlike vLLM: JSON comes out on one line with the
separators of Python's json.dumps, so a weak model cannot fill its budget with whitespace; false
allows any whitespace between JSON tokens).

Standard library only: the web tier checks the shape with it before building the grammar.
"""

from __future__ import annotations

import json
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace",)
# A grammar is compiled per distinct spec and held in a bounded cache; a huge one would cost the
# engine memory and compile time every tenant shares.
MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 1024


class StructuredOutputsError(ValueError):
    """The request's structured output constraint is malformed, unsupported or invalid."""

    def __init__(self, message: str, *, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


def structured_outputs_check(value: Any) -> dict[str, Any] | None:
    """The canonical spec ({constraint: value, "disable_any_whitespace": bool}) or None for no
    constraint; raises StructuredOutputsError naming the problem."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StructuredOutputsError("structured_outputs must be an object.")
    unknown = [k for k in value if k not in CONSTRAINTS and k not in OPTIONS]
    if unknown:
        raise StructuredOutputsError(
            f"Unknown structured_outputs field {unknown[0]!r}; use one of {', '.join(CONSTRAINTS)}."
        )
    given = [k for k in CONSTRAINTS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise StructuredOutputsError(
            f"structured_outputs takes exactly one of {', '.join(CONSTRAINTS)}; got {len(given)}."
        )
    kind = given[0]
    whitespace = value.get("disable_any_whitespace", True)
    if not isinstance(whitespace, bool):
        raise StructuredOutputsError("structured_outputs.disable_any_whitespace must be a boolean.")
    spec: dict[str, Any] = {kind: _checked(kind, value[kind]), "disable_any_whitespace": whitespace}
    if len(spec_key(spec)) > MAX_SPEC_CHARS:
        raise StructuredOutputsError(
            f"The structured output constraint may be at most {MAX_SPEC_CHARS} characters."
        )
    return spec


def _checked(kind: str, value: Any) -> Any:
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise StructuredOutputsError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise StructuredOutputsError(f"{where} must be a JSON schema object.")
        return value
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputsError(f"{where} must be true.")
        return True
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise StructuredOutputsError(f"{where} must be a list of 1 to {MAX_CHOICES} non-empty strings.")
        return list(value)
    if not isinstance(value, str) or not value:
        raise StructuredOutputsError(f"{where} must be a non-empty string.")
    return value


def spec_key(spec: dict[str, Any]) -> str:
    """One text per distinct constraint: the key of the grammar caches."""
    return json.dumps(spec, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
