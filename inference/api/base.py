"""The generation endpoints' view: a validated body, started by the one generation service, answered
as JSON or streamed as server-sent events."""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, HttpResponse
from rest_framework import serializers

from core.api.base import ApiView, json_body
from core.concurrency import blocking
from core.errors import PlatformError
from inference import metrics
from inference.api.body_json import body_json
from inference.api.serializers import generation_input
from inference.api.sse import sse_response
from inference.services import GenerationPlan, collect_choices, generation_start


def _read_timeout(request: HttpRequest) -> float | None:
    """The official SDKs send their timeout as x-stainless-read-timeout (seconds): a request still
    waiting to start after that long has a client that gave up on it. Unreadable: none."""
    try:
        value = float(request.headers.get("x-stainless-read-timeout", ""))
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


class GenerationApi(ApiView):
    kind: str  # chat | completion
    InputSerializer: type[serializers.Serializer]

    def response_body(self, plan: GenerationPlan, choices: list, usage) -> dict[str, Any]:
        raise NotImplementedError

    async def authenticate(self, request: HttpRequest) -> Any:
        try:
            return await super().authenticate(request)
        except PlatformError as exc:
            metrics.record_refused(tenant=None, model=None, code=exc.code)
            raise

    async def post(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        try:
            # In a thread: a body of megabytes takes the parser and the serializers a while, and
            # every stream of this process waits while the event loop does anything.
            data = await blocking(_generation_body)(request, self.InputSerializer)
        except PlatformError as exc:
            metrics.record_refused(tenant=self.auth.tenant_slug, model=None, code=exc.code)
            raise
        generation, events = await generation_start(
            auth=self.auth,
            kind=self.kind,
            data=data,
            request_id=self.request_id,
            started_at=started,
            request_counted=True,  # by the base view, before the body was read
            client_timeout_s=_read_timeout(request),
        )
        self.ratelimit_headers = generation.ratelimit_headers
        plan = generation.plan
        if plan.stream:
            return sse_response(generation, events)
        choices = await collect_choices(events, count=plan.n * len(plan.prompts), n=plan.n)
        # In a thread, as the body was read: logprobs make bodies of many megabytes.
        return await blocking(self._json_response)(plan, choices, generation.usage)

    def _json_response(self, plan: GenerationPlan, choices: list, usage) -> HttpResponse:
        body = body_json(self.response_body(plan, choices, usage))
        return HttpResponse(body, content_type="application/json")


def _generation_body(request: HttpRequest, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    return generation_input(json_body(request), serializer_class)
