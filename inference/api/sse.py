"""Server-sent events for streamed completions, in OpenAI's chunk shapes.

A failure after the stream began cannot change the status line any more: it is reported as
`data: {"error": {...}}` followed by `data: [DONE]`, which the OpenAI SDKs raise as an APIError.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from django.http import StreamingHttpResponse

from core.errors import PlatformError
from inference.api import formatting
from inference.services import ChoiceDelta, ChoiceFinished, Generation

logger = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _choice(generation: Generation, item: ChoiceDelta | ChoiceFinished, offsets: dict[int, int]) -> dict:
    plan = generation.plan
    if isinstance(item, ChoiceFinished):
        if plan.kind == "chat":
            return {"index": item.index, "delta": {}, "logprobs": None, "finish_reason": item.finish_reason}
        return {"index": item.index, "text": "", "logprobs": None, "finish_reason": item.finish_reason}
    if plan.kind == "chat":
        return {
            "index": item.index,
            "delta": {"content": item.text},
            "logprobs": formatting.chat_logprobs(plan, item.logprobs),
            "finish_reason": None,
        }
    logprobs = formatting.completion_logprobs(plan, item.logprobs, offset=offsets[item.index])
    if logprobs is not None:
        # Counted over the tokens' own texts, as the full answer does: the streamed text holds back
        # a character split over several tokens, and offsets must not depend on how it was chunked.
        offsets[item.index] += sum(len(token) for token in logprobs["tokens"])
    return {"index": item.index, "text": item.text, "logprobs": logprobs, "finish_reason": None}


async def sse_stream(generation: Generation, events: AsyncIterator) -> AsyncIterator[bytes]:
    plan = generation.plan
    offsets: dict[int, int] = defaultdict(int)
    try:
        if plan.kind == "chat":
            for index in range(plan.n * len(plan.prompts)):
                role = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _data(formatting.chunk(plan, [role]))
        async for item in events:
            if isinstance(item, ChoiceDelta) and not item.text and not item.token_ids:
                continue
            yield _data(formatting.chunk(plan, [_choice(generation, item, offsets)]))
        if plan.include_usage:
            yield _data(formatting.chunk(plan, [], usage=generation.usage))
    except PlatformError as exc:
        yield _data(exc.as_body())
    except Exception:
        logger.exception("stream %s failed", plan.request_id)
        yield _data(PlatformError().as_body())
    yield DONE


def sse_response(generation: Generation, events: AsyncIterator) -> StreamingHttpResponse:
    response = StreamingHttpResponse(sse_stream(generation, events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must pass each event on at once
    return response
