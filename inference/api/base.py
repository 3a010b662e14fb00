"""What the /v1 generation views share: body parsing, error rendering, the admission handshake."""

from __future__ import annotations

import json
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers

from core.api.exceptions import error_response, to_platform_error
from core.errors import InvalidRequestError, MethodNotAllowedError, PlatformError
from core.request_ids import new_request_id
from inference import metrics
from inference.api.auth import authenticate_header
from inference.api.fields import refuse_unsupported
from inference.api.sse import sse_response
from inference.services import Generation, GenerationPlan, collect_choices


def error_json(exc: Exception, request_id: str) -> JsonResponse:
    response = error_response(exc)
    response["x-request-id"] = request_id
    return response


def parse_body(request: HttpRequest, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    if request.content_type and request.content_type != "application/json":
        raise InvalidRequestError("The request body must be JSON (Content-Type: application/json).")
    try:
        body = json.loads(request.body or b"null")
    # RecursionError: nesting deeper than the parser's stack is bad input too, not a crash.
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequestError(
            f"We could not parse the JSON body of your request. ({exc})", code="invalid_json"
        ) from exc
    return parse_body_data(body, serializer_class)


def parse_body_data(body: Any, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    serializer = serializer_class(data=body)
    try:
        refuse_unsupported(body, set(serializer.fields))
        serializer.is_valid(raise_exception=True)
    except serializers.ValidationError as exc:
        raise to_platform_error(exc) from exc
    return dict(serializer.validated_data)


@method_decorator(csrf_exempt, name="dispatch")
class ApiView(View):
    """An async view answering every error, 405 included, in OpenAI's shape."""

    def http_method_not_allowed(self, request, *args, **kwargs):
        response = error_json(
            MethodNotAllowedError(f"Method {request.method} is not allowed on {request.path}."),
            new_request_id(),
        )

        async def func():
            return response

        return func()


class GenerationApi(ApiView):
    InputSerializer: type[serializers.Serializer]

    def plan_create(self, **kwargs: Any) -> GenerationPlan:
        raise NotImplementedError

    def response_body(self, plan: GenerationPlan, choices: list, usage) -> dict[str, Any]:
        raise NotImplementedError

    async def post(self, request: HttpRequest) -> HttpResponse:
        request_id = new_request_id()
        started = time.perf_counter()
        auth = plan = None
        try:
            auth = await authenticate_header(request.headers.get("Authorization"))
            data = parse_body(request, self.InputSerializer)
            plan = await sync_to_async(self.plan_create)(auth=auth, data=data, request_id=request_id)
            generation = Generation(auth=auth, plan=plan, started_at=started)
            events = generation.run()
            await anext(events)  # admitted and queued; refusals raise here, before any byte is sent
        except PlatformError as exc:
            metrics.record_refused(
                tenant=auth.tenant_slug if auth else None, model=plan.model if plan else None, code=exc.code
            )
            return error_json(exc, request_id)
        headers = {**generation.ratelimit_headers, "x-request-id": request_id}
        if plan.stream:
            return sse_response(generation, events, headers)
        try:
            choices = await collect_choices(events, count=plan.n * len(plan.prompts))
        except PlatformError as exc:
            response = error_json(exc, request_id)
        else:
            response = JsonResponse(self.response_body(plan, choices, generation.usage))
        for name, value in headers.items():
            response[name] = value
        return response
