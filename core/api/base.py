"""The one base of every /v1 view, sync or async handlers alike.

For each request it: assigns the request id (sent back as `x-request-id` on every answer, errors
included); authenticates the API key; counts the request against the tenant's requests/min limit
before the body is read (generations reserve their tokens later, in their own admission); runs the
handler (a sync handler runs in a thread, so it may use the ORM); and renders any error
in OpenAI's shape with `core.api.exceptions.error_response`, the one renderer.

Who authenticates and who counts requests is configured, as DRF configures its authentication
classes, so this package depends on no app: `API_AUTHENTICATE` is called as
`f(authorization=<header value>)` and returns the caller's context (it raises a PlatformError to
refuse); `API_REQUEST_ADMIT` is called as `f(auth=<context>, request_id=...)` and returns the
x-ratelimit-* headers (it raises RateLimitError when over).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.utils.decorators import method_decorator
from django.utils.module_loading import import_string
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail

from core.actor import SYSTEM, Actor, acting_as
from core.api.exceptions import error_response, refusal_held, to_platform_error
from core.client_address import client_address
from core.concurrency import blocking
from core.errors import InvalidRequestError, MethodNotAllowedError, PermissionDeniedError, PlatformError
from core.request_ids import new_request_id


@cache
def _configured(name: str) -> Callable[..., Any]:
    return import_string(getattr(settings, name))


def unknown_field_error(name: str) -> serializers.ValidationError:
    """OpenAI's answer to a field it does not know: "Unrecognized request argument supplied"."""
    message = f"Unrecognized request argument supplied: {name}"
    return serializers.ValidationError({name: [ErrorDetail(message, code="unknown_parameter")]})


class StrictSerializer(serializers.Serializer):
    """Input serializer that refuses unknown fields."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            unknown = [name for name in data if name not in self.fields]
            if unknown:
                raise unknown_field_error(unknown[0])
        return super().to_internal_value(data)


# One instance of each input serializer per thread, used again for every body it validates: a
# serializer deep-copies its declared fields, nested ones too, when it is made (0.8 of the 1.0 ms a
# chat completion's body took to validate). Validation keeps no state between bodies but
# `initial_data`, which is set for each; a thread validates one body at a time.
_serializers = threading.local()


def validated(serializer_class: type[serializers.Serializer], data: Any) -> dict[str, Any]:
    """The serializer's validated data, or the InvalidRequestError naming the first bad field."""
    made: dict[type[serializers.Serializer], serializers.Serializer] = _serializers.__dict__.setdefault(
        "by_class", {}
    )
    serializer = made.get(serializer_class)
    if serializer is None:
        serializer = made[serializer_class] = serializer_class()
    serializer.initial_data = data
    try:
        # What is_valid runs, and raises as it does: the errors of every field, as a dict.
        return dict(serializer.run_validation(data))
    except serializers.ValidationError as exc:
        raise (to_platform_error(exc) or exc) from exc
    finally:
        del serializer.initial_data


def json_body(request: HttpRequest) -> dict[str, Any]:
    """The request body as a JSON object, or an InvalidRequestError saying why it is not one."""
    if request.content_type and request.content_type != "application/json":
        raise InvalidRequestError("The request body must be JSON (Content-Type: application/json).")
    try:
        body = json.loads(request.body or b"null")
    # RecursionError: nesting deeper than the parser's stack is bad input too, not a crash.
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequestError(
            f"We could not parse the JSON body of your request. ({exc})", code="invalid_json"
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return body


@method_decorator(csrf_exempt, name="dispatch")
class ApiView(View):
    """Handlers (`get`, `post`, `delete`, ...) are sync or async, take the request and the URL's
    arguments, and return an HttpResponse or JSON-serialisable data (answered with 200). They
    find the caller in `self.auth` and the request id in `self.request_id`."""

    # True for documentation anyone may read (the OpenAPI schema): no key is asked for, and no
    # request counted, since there is no tenant to count it against.
    public = False
    # True where a sync handler's work grows with its body (tokenization): it then runs in a thread
    # of the pool rather than on Django's one shared thread, where it would hold up every other
    # request's authentication on this process.
    handler_in_pool = False
    # The scope a key needs here (the caller's context lists its `scopes`): "inference" for the
    # model endpoints, "manage" for what manages a tenant's adapters, files, batches and usage.
    required_scope = "inference"
    # Always dispatched as a coroutine: the handlers below may be sync or async.
    view_is_async = True

    auth: Any = None
    request_id: str = ""
    ratelimit_headers: dict[str, str]
    # The renderer of this view's errors: OpenAI's shape, unless the view speaks another API's.
    render_error: Callable[[Exception], HttpResponseBase] = staticmethod(error_response)

    async def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        self.request_id = new_request_id()
        self.ratelimit_headers = {}
        try:
            response = await self._handle(request, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - rendered in the API's shape (an unknown one is logged)
            if isinstance(exc, PlatformError) and exc.status_code == 429:
                self.ratelimit_headers = {}  # the error carries its own, fresher ones
            await refusal_held(exc)
            response = self.render_error(exc)
        for name, value in self.ratelimit_headers.items():
            if not response.has_header(name):
                response[name] = value
        response["x-request-id"] = self.request_id
        return response

    async def _handle(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        method = request.method.lower()
        handler = getattr(self, method, None) if method in self.http_method_names else None
        if method == "options" or handler is None:
            return self._without_handler(request)
        if not self.public:
            self.auth, self.ratelimit_headers = await self.authenticate_and_count(request)
            # After the count: a refused request costs its sender a request, as any other does.
            scopes = getattr(self.auth, "scopes", (self.required_scope,))
            if self.required_scope not in scopes:
                raise PermissionDeniedError(
                    f"This API key lacks the '{self.required_scope}' scope that "
                    f"{request.method} {request.path} needs (it has: {', '.join(scopes)})."
                )
        actor = SYSTEM
        if self.auth is not None:
            actor = Actor(
                source="api",
                api_key_id=getattr(self.auth, "api_key_id", None),
                api_key_prefix=getattr(self.auth, "api_key_prefix", ""),
                address=client_address(request),
            )
        with acting_as(actor):
            if iscoroutinefunction(handler):
                result = await handler(request, *args, **kwargs)
            else:
                call = blocking if self.handler_in_pool else sync_to_async
                result = await call(handler)(request, *args, **kwargs)
        return result if isinstance(result, HttpResponseBase) else JsonResponse(result, safe=False)

    def _without_handler(self, request: HttpRequest) -> HttpResponseBase:
        allowed = ", ".join(m.upper() for m in self.http_method_names if m != "options" and hasattr(self, m))
        if request.method.lower() == "options":
            response = HttpResponse(status=204)
        else:
            response = self.render_error(
                MethodNotAllowedError(f"Method {request.method} is not allowed on {request.path}.")
            )
        response["Allow"] = f"{allowed}, OPTIONS" if allowed else "OPTIONS"
        return response

    def authorization(self, request: HttpRequest) -> str | None:
        """The credentials sent: the Authorization header's value, else an `x-api-key` header's key
        (as Anthropic's SDK sends it) as a Bearer token."""
        key = request.headers.get("x-api-key")
        return request.headers.get("Authorization") or (f"Bearer {key}" if key else None)

    def key_refused(self, exc: PlatformError) -> None:
        """Called with the error of a key refused, before anything is counted; nothing by default."""

    async def authenticate_and_count(self, request: HttpRequest) -> tuple[Any, dict[str, str]]:
        """The caller's context and the x-ratelimit-* headers of its request, counted: both in one
        thread hop (each is a Redis round trip at least). Thread-sensitive, as Django runs sync
        code: the request's thread, whose database connection is the one a test's transaction
        holds."""
        authorization, request_id = self.authorization(request), self.request_id

        def check() -> tuple[Any, dict[str, str]]:
            try:
                auth = _configured("API_AUTHENTICATE")(authorization=authorization)
            except PlatformError as exc:
                self.key_refused(exc)
                raise
            return auth, _configured("API_REQUEST_ADMIT")(auth=auth, request_id=request_id)

        return await sync_to_async(check)()
