"""A response body as JSON bytes, written in pieces that each hold the interpreter only briefly.

One `orjson.dumps` (or `json.dumps`) of a whole body is one call into C that holds the GIL until it
returns: for a body of millions of logprob entries that is every stream of the process stalled,
even when the call runs in a thread. Here the body's outer containers are walked in Python, long
lists are written in slices, and an object several choices share (an echoed prompt's logprobs) is
written once and its bytes reused. The bytes are those of `orjson.dumps(body)`.
"""

from __future__ import annotations

from typing import Any

import orjson

# Containers this shallow are walked (the body, its choices, a choice, its logprobs and
# prompt_logprobs); deeper ones are written whole, but for lists longer than SLICE, which are
# written SLICE items at a time. What a choice holds (depth SHARED_DEPTH) is remembered by identity.
WALK_DEPTH = 3
SHARED_DEPTH = 3
SLICE = 256


def body_json(body: Any) -> bytes:
    out: list[bytes] = []
    _write(body, 0, out, {})
    return b"".join(out)


def _write(value: Any, depth: int, out: list[bytes], seen: dict[int, bytes]) -> None:
    if not isinstance(value, dict | list):
        out.append(orjson.dumps(value))
        return
    known = seen.get(id(value))
    if known is not None:
        out.append(known)
        return
    start = len(out)
    if isinstance(value, list) and len(value) > SLICE:
        out.append(b"[")
        for i in range(0, len(value), SLICE):
            if i:
                out.append(b",")
            out.append(orjson.dumps(value[i : i + SLICE])[1:-1])
        out.append(b"]")
    elif depth > WALK_DEPTH or not value:
        out.append(orjson.dumps(value))
    elif isinstance(value, list):
        out.append(b"[")
        for i, item in enumerate(value):
            if i:
                out.append(b",")
            _write(item, depth + 1, out, seen)
        out.append(b"]")
    else:
        out.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            out.append(b',"' if i else b'"')
            out.append(orjson.dumps(key)[1:])  # the quoted key, its opening quote written above
            out.append(b":")
            _write(item, depth + 1, out, seen)
        out.append(b"}")
    if depth == SHARED_DEPTH:
        # By identity: the body keeps the object alive while it is written.
        seen[id(value)] = b"".join(out[start:])
