"""Request ids: one per API call, sent back as `x-request-id` and used as the engine's request id."""

from __future__ import annotations

import uuid


def new_request_id() -> str:
    return uuid.uuid4().hex
