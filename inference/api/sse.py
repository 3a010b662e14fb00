"""Server-sent events for streamed completions, in OpenAI's chunk shapes.

A failure after the stream began cannot change the status line any more: it is reported as
`data: {"error": {...}}` followed by `data: [DONE]`, which the OpenAI SDKs raise as an APIError.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import orjson
from django.http import StreamingHttpResponse

from core.errors import PlatformError
from inference.api import formatting
from inference.api.chat_output import ChoiceMessageStream
from inference.services import ChoiceDelta, ChoiceFinished, Generation

logger = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def _data(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class _ChoiceFrames:
    """SSE events of one-choice chunks: every field but the choice is the same in each chunk of a
    stream, so it is serialised once and only the choice per token (same bytes as _data(chunk))."""

    def __init__(self, plan) -> None:
        constant = orjson.dumps(formatting.chunk(plan, []))
        head, tail = constant.split(b'"choices":[]', 1)
        self.head = b"data: " + head + b'"choices":['
        self.tail = b"]" + tail + b"\n\n"

    def __call__(self, choice: dict[str, Any]) -> bytes:
        return self.head + orjson.dumps(choice) + self.tail


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


def _tool_choices(
    generation: Generation, item: ChoiceDelta | ChoiceFinished, streams: dict[int, ChoiceMessageStream]
) -> list[dict[str, Any]]:
    """The chunks' choices of one item in a chat with tools: its text read into content and
    tool-call deltas (none while a call is being read), then the finish."""
    plan = generation.plan
    stream = streams.get(item.index)
    if stream is None:
        stream = streams[item.index] = ChoiceMessageStream(plan)
    if isinstance(item, ChoiceFinished):
        deltas, reason = stream.finish(item.finish_reason)
        out = [{"index": item.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        return [*out, {"index": item.index, "delta": {}, "logprobs": None, "finish_reason": reason}]
    logprobs = formatting.chat_logprobs(plan, item.logprobs)
    deltas = stream.feed(item.text)
    if not deltas and logprobs is not None:
        deltas = [{}]  # the tokens' logprobs go out even while their text is held back
    out = []
    for delta in deltas:
        out.append({"index": item.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
        logprobs = None
    return out


async def sse_stream(generation: Generation, events: AsyncIterator) -> AsyncIterator[bytes]:
    plan = generation.plan
    offsets: dict[int, int] = defaultdict(int)
    frame = _ChoiceFrames(plan)
    tool_streams: dict[int, ChoiceMessageStream] | None = {} if plan.tool_mode is not None else None
    try:
        if plan.kind == "chat":
            for index in range(plan.n * len(plan.prompts)):
                role = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield frame(role)
        async for item in events:
            if isinstance(item, ChoiceDelta) and not item.text and not item.token_ids:
                continue
            if tool_streams is not None:
                for choice in _tool_choices(generation, item, tool_streams):
                    yield frame(choice)
                continue
            yield frame(_choice(generation, item, offsets))
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
