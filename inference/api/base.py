"""The generation endpoints' view: a validated body, started by the one generation service, answered
as JSON or streamed as server-sent events."""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import serializers

from core.api.base import ApiView, json_body
from core.errors import PlatformError
from inference import metrics
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
            data = generation_input(json_body(request), self.InputSerializer)
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
        return JsonResponse(self.response_body(plan, choices, generation.usage))
