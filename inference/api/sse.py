"""Server-sent events of a streamed generation, whatever its wire format: the format's renderer
(a formatting.ChunkStream) makes each chunk.

A failure after the stream began cannot change the status line any more: it is reported as
`data: {"error": {...}}` followed by `data: [DONE]`, which the OpenAI SDKs raise as an APIError.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from django.http import StreamingHttpResponse

from core.errors import PlatformError
from inference.api.formatting import ChunkStream
from inference.services import ChoiceDelta, Generation

logger = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class _ChoiceFrames:
    """SSE events of one-choice chunks: every field but the choice is the same in each chunk of a
    stream, so it is serialised once and only the choice per token (same bytes as _data(chunk))."""

    def __init__(self, renderer: ChunkStream) -> None:
        constant = orjson.dumps(renderer.chunk([]))
        head, tail = constant.split(b'"choices":[]', 1)
        self.head = b"data: " + head + b'"choices":['
        self.tail = b"]" + tail + b"\n\n"

    def __call__(self, choice: dict[str, Any]) -> bytes:
        return self.head + orjson.dumps(choice) + self.tail


async def sse_stream(
    generation: Generation, events: AsyncIterator, renderer: ChunkStream
) -> AsyncIterator[bytes]:
    plan = generation.plan
    frame = _ChoiceFrames(renderer)
    try:
        for choice in renderer.opening():
            yield frame(choice)
        async for item in events:
            if isinstance(item, ChoiceDelta) and not item.text and not item.token_ids:
                continue
            for choice in renderer.choices(item):
                yield frame(choice)
        if plan.include_usage:
            yield _data(renderer.chunk([], usage=generation.usage))
    except PlatformError as exc:
        yield _data(exc.as_body())
    except Exception:
        logger.exception("stream %s failed", plan.request_id)
        yield _data(PlatformError().as_body())
    yield DONE


def sse_response(
    generation: Generation, events: AsyncIterator, renderer: ChunkStream
) -> StreamingHttpResponse:
    response = StreamingHttpResponse(
        sse_stream(generation, events, renderer), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must pass each event on at once
    return response
