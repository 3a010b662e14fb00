"""Grammars of structured output specs (xgrammar), built without a tokenizer.

The web tier calls `grammar_check` before queueing, so a schema xgrammar cannot serve is a 400 that
names the problem; the engine calls `build_grammar` and compiles the result for its tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from engine.structured_output.spec import StructuredOutputsError, spec_key

# json_object: any JSON object. Not strict: its properties are whatever the model writes.
_ANY_OBJECT = '{"type": "object"}'


def build_grammar(spec: dict[str, Any]) -> Any:
    """The xgrammar Grammar of a canonical spec; StructuredOutputsError when xgrammar refuses it."""
    import xgrammar as xgr

    compact = spec.get("disable_any_whitespace", True)
    try:
        if "json" in spec:
            # strict_mode: no properties or items beyond the schema's (vLLM's xgrammar default).
            return xgr.Grammar.from_json_schema(
                json.dumps(spec["json"]), any_whitespace=not compact, strict_mode=True
            )
        if "json_object" in spec:
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=not compact, strict_mode=False)
        if "regex" in spec:
            return xgr.Grammar.from_regex(spec["regex"])
        if "choice" in spec:
            # ensure_ascii: EBNF string literals take JSON's escapes, \uXXXX included.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=True) for c in spec["choice"])
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        if "grammar" in spec:
            return xgr.Grammar.from_ebnf(spec["grammar"])
    except (RuntimeError, ValueError, TypeError) as exc:
        kind = next(k for k in ("json", "json_object", "regex", "choice", "grammar") if k in spec)
        raise StructuredOutputsError(
            f"The {_NAMES[kind]} cannot be used for structured output: {_reason(exc)}"
        ) from exc
    raise AssertionError(f"not a canonical spec: {spec!r}")


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


def _reason(exc: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /project/cpp/file.cc:line: "; the caller wants the rest.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head, sep, rest = text.partition(".cc:")
    if sep:
        _, _, text = rest.partition(": ")
    return text.strip() or type(exc).__name__


# Digests of specs whose grammar was built, most recent last: the cache holds 32 bytes per spec,
# never the spec itself (512 specs of the largest size would pin tens of megabytes).
_CHECKED_MAX = 512
_checked: OrderedDict[bytes, None] = OrderedDict()
_checked_lock = threading.Lock()


def grammar_check(spec: dict[str, Any]) -> None:
    """Raise StructuredOutputsError when the spec's grammar cannot be built (cached per spec)."""
    digest = hashlib.sha256(spec_key(spec).encode()).digest()
    with _checked_lock:
        if digest in _checked:
            _checked.move_to_end(digest)
            return
    build_grammar(spec)
    with _checked_lock:
        _checked[digest] = None
        while len(_checked) > _CHECKED_MAX:
            _checked.popitem(last=False)
