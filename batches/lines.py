"""A batch line is one more wire format: its body is checked by the endpoint's own serializer, planned
and run by the one generation service (admission, quota, tiers, the ledger) at the `flex` tier, and
its answer rendered by the endpoint's own renderer, so a line answers exactly what the same request
sent interactively would.

A line's engine requests are queued once (EngineGateway.submit(once=True)) under a request id of
its attempt, counted in the database before the submission: a runner that resumes a line whose
attempt reached the engines reads that attempt's events instead of submitting again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from batches.services import batch_line_attempt
from core.concurrency import blocking
from core.errors import (
    InvalidRequestError,
    PlatformError,
    QuotaExceededError,
    RateLimitError,
    ServiceUnavailableError,
)
from inference.api.base import generation_input
from inference.api.chat_completions.views import ChatCompletionCreateApi
from inference.api.completions.views import CompletionCreateApi
from inference.api.embeddings.schema import EmbeddingInputSerializer
from inference.api.embeddings.views import embedding_answer
from inference.gateway import get_gateway
from inference.services import (
    Generation,
    GenerationPlan,
    collect_choices,
    generation_attach,
    generation_start,
)

# The tier batch lines run at: only on capacity interactive requests leave.
BATCH_TIER = "flex"


@dataclass(frozen=True)
class Endpoint:
    kind: str  # the generation service's planner: chat | completion | embedding
    serializer: Any


ENDPOINTS = {
    "/v1/chat/completions": Endpoint("chat", ChatCompletionCreateApi.InputSerializer),
    "/v1/completions": Endpoint("completion", CompletionCreateApi.InputSerializer),
    "/v1/embeddings": Endpoint("embedding", EmbeddingInputSerializer),
}


def line_data(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """A line's body as the endpoint's validated data, at the batch tier; InvalidRequestError (the
    endpoint's own, naming the field) for a body it refuses, or one asking to stream."""
    if body.get("stream"):
        raise InvalidRequestError(
            "A batch line cannot stream: its answer is written to the output file.", param="stream"
        )
    data = generation_input(
        {**body, "stream": False} if "stream" in body else body, ENDPOINTS[endpoint].serializer
    )
    data["service_tier"] = BATCH_TIER
    return data


def check_body(endpoint: str, body: dict[str, Any]) -> None:
    line_data(endpoint, body)


@dataclass
class LineOutcome:
    response: dict[str, Any] | None = None  # {status_code, request_id, body}
    error: dict[str, Any] | None = None
    retry: bool = False  # not run (no capacity, rate limits): pending, to be tried again


RETRYABLE = (ServiceUnavailableError, RateLimitError)


def request_id_of(batch_id: str, index: int, attempt: int) -> str:
    return f"{batch_id}-{index}-{attempt}"


async def line_run(
    *,
    auth: Any,
    batch_id: str,
    endpoint: str,
    line_id: int,
    index: int,
    body: dict,
    attempt: int,
    window_s: float,
) -> LineOutcome:
    """Run one line to its outcome. `attempt` is the line's attempts so far; `window_s` what is left
    of the batch's completion window (a queued line that has not started by then is dropped)."""
    kind = ENDPOINTS[endpoint].kind
    try:
        data = line_data(endpoint, body)
        previous = request_id_of(batch_id, index, attempt) if attempt else ""
        if previous and await _reached_engines(previous):
            generation, events = await generation_attach(auth=auth, kind=kind, data=data, request_id=previous)
            request_id = previous
        else:
            attempt = await blocking(batch_line_attempt)(line_id=line_id)
            request_id = request_id_of(batch_id, index, attempt)
            generation, events = await generation_start(
                auth=auth,
                kind=kind,
                data=data,
                request_id=request_id,
                started_at=time.perf_counter(),
                client_timeout_s=max(window_s, 1.0),
                batch_id=batch_id,
            )
        body_out = await _answer(generation, events, data)
    except QuotaExceededError as exc:
        return LineOutcome(response={"status_code": exc.status_code, "request_id": "", "body": exc.as_body()})
    except RETRYABLE:
        return LineOutcome(retry=True)
    except PlatformError as exc:
        return LineOutcome(response={"status_code": exc.status_code, "request_id": "", "body": exc.as_body()})
    return LineOutcome(response={"status_code": 200, "request_id": request_id, "body": body_out})


async def _reached_engines(request_id: str) -> bool:
    """Whether an attempt's engine requests were queued (a request of several prompts is queued
    under `<id>-<i>`; the first tells)."""
    gateway = get_gateway()
    return await gateway.was_submitted(request_id) or await gateway.was_submitted(f"{request_id}-0")


async def _answer(generation: Generation, events: AsyncIterator, data: dict[str, Any]) -> dict[str, Any]:
    plan: GenerationPlan = generation.plan
    if plan.inputs is not None:  # embeddings
        return await embedding_answer(generation, events, data)
    choices = await collect_choices(events, count=plan.n * len(plan.prompts), n=plan.n)
    render: Callable = (
        ChatCompletionCreateApi.render_body if plan.kind == "chat" else CompletionCreateApi.render_body
    )
    return render(plan, choices, generation.usage)
