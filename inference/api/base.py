"""The generation endpoints' view: a body validated by its wire format's serializer (the same way
whichever transport carries it, REST or the websocket), started by the one generation service,
answered as JSON or streamed as server-sent events by the format's renderers."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

from django.http import HttpRequest, HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers

from core.api.base import ApiView, json_body, validated
from core.api.exceptions import to_platform_error
from core.api.openapi import api_errors
from core.concurrency import blocking
from core.errors import InvalidRequestError, PlatformError
from inference import metrics
from inference.api.body_json import body_json
from inference.api.fields import refuse_unsupported
from inference.api.formatting import ChunkStream
from inference.api.responses import EVENT_STREAM
from inference.api.sse import sse_response
from inference.services import Generation, GenerationPlan, collect_choices, generation_start

T = TypeVar("T")


def read_timeout(request: HttpRequest) -> float | None:
    """The official SDKs send their timeout as x-stainless-read-timeout (seconds): a request still
    waiting to start after that long has a client that gave up on it. Unreadable: none."""
    try:
        value = float(request.headers.get("x-stainless-read-timeout", ""))
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


class CountedRefusalsApi(ApiView):
    """A generation view of any wire format: a key refused before the body is read is counted
    in the refusal metrics too."""

    def key_refused(self, exc: PlatformError) -> None:
        metrics.record_refused(tenant=None, model=None, code=exc.code)

    async def start_generation(
        self,
        request: HttpRequest,
        *,
        kind: str,
        read: Callable[[HttpRequest], T],
        data_of: Callable[[T], dict[str, Any]] | None = None,
    ) -> tuple[Generation, AsyncIterator, T]:
        """The request's body read by `read` (in a thread of the pool: a body of megabytes takes
        the parser and the serializers a while, and every stream of this process waits while the
        event loop does anything; a refusal counted), its validated data (`data_of` what `read`
        returned, or that itself) planned as `kind`, admitted and queued by the one generation
        service; its x-ratelimit-* headers kept for the answer. Returns what `read` returned too."""
        started = time.perf_counter()
        try:
            parsed = await blocking(read)(request)
        except PlatformError as exc:
            metrics.record_refused(tenant=self.auth.tenant_slug, model=None, code=exc.code)
            raise
        generation, events = await generation_start(
            auth=self.auth,
            kind=kind,
            data=data_of(parsed) if data_of is not None else cast(dict[str, Any], parsed),
            request_id=self.request_id,
            started_at=started,
            request_counted=True,  # by the base view, before the body was read
            client_timeout_s=read_timeout(request),
        )
        self.ratelimit_headers = generation.ratelimit_headers
        return generation, events, parsed


class GenerationApi(CountedRefusalsApi):
    """A generation endpoint of one wire format, declared by its subclass: its parser
    (InputSerializer) into the one plan, its renderers of the one event stream (render_body for a
    whole body, Stream for chunks), and its OpenAPI description (operation_id, summary, the
    OutputSerializer of a whole body)."""

    kind: str  # chat | completion
    InputSerializer: type[serializers.Serializer]
    OutputSerializer: type[serializers.Serializer]
    Stream: Callable[[GenerationPlan], ChunkStream]
    render_body: Callable[[GenerationPlan, list, Any], dict[str, Any]]
    operation_id: str
    summary: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)

        async def post(self: GenerationApi, request: HttpRequest) -> HttpResponse:
            return await GenerationApi.post(self, request)

        cls.post = generation_schema(  # type: ignore[method-assign]  # the same post, described per format
            operation_id=cls.operation_id,
            summary=cls.summary,
            request=cls.InputSerializer,
            response=cls.OutputSerializer,
        )(post)

    async def post(self, request: HttpRequest) -> HttpResponse:
        generation, events, _ = await self.start_generation(
            request,
            kind=self.kind,
            read=functools.partial(_generation_body, serializer_class=self.InputSerializer),
        )
        plan = generation.plan
        if plan.stream:
            return sse_response(generation, events, self.Stream(plan))
        choices = await collect_choices(events, count=plan.n * len(plan.prompts), n=plan.n)
        # In a thread, as the body was read: logprobs make bodies of many megabytes.
        return await blocking(self._json_response)(plan, choices, generation.usage)

    def _json_response(self, plan: GenerationPlan, choices: list, usage) -> HttpResponse:
        body = body_json(type(self).render_body(plan, choices, usage))
        return HttpResponse(body, content_type="application/json")


def _generation_body(request: HttpRequest, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    return generation_input(json_body(request), serializer_class)


@functools.cache
def _field_names(serializer_class: type[serializers.Serializer]) -> frozenset[str]:
    # A serializer deep-copies its declared fields whenever one is made: once per class is enough.
    return frozenset(serializer_class().fields)


def generation_input(body: Any, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    """A generation body's validated data; the first unsupported, unknown or invalid field is an
    InvalidRequestError naming it."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        refuse_unsupported(body, _field_names(serializer_class))
    except serializers.ValidationError as exc:
        raise to_platform_error(exc) from exc
    return validated(serializer_class, body)


def generation_schema(
    *,
    operation_id: str,
    summary: str,
    request: type[serializers.Serializer],
    response: type[serializers.Serializer],
) -> Callable:
    """The OpenAPI description of a generation endpoint's POST: its body, its JSON answer or an
    event stream, and the errors every generation endpoint can answer with."""
    return extend_schema(
        operation_id=operation_id,
        summary=summary,
        request=request,
        responses={
            (200, "application/json"): response,
            (200, "text/event-stream"): EVENT_STREAM,
            **api_errors(400, 404, 413),
        },
    )
