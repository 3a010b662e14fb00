"""Project-wide middleware: Prometheus request metrics by route (the URL pattern, never the raw
path: bounded labels), and the guarantee that every /v1 answer is JSON and carries an x-request-id."""

from __future__ import annotations

import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from prometheus_client import Counter, Histogram
from whitenoise.middleware import WhiteNoiseMiddleware

from core.api.exceptions import error_for_status, error_response
from core.request_ids import new_request_id

HTTP_REQUESTS = Counter("pagoda_http_requests_total", "HTTP requests handled", ["method", "route", "status"])
HTTP_LATENCY = Histogram(
    "pagoda_http_request_duration_seconds",
    "HTTP request latency until the response object is returned (streams: until headers)",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}


def _route(request) -> str:
    match = getattr(request, "resolver_match", None)
    if match is None or not match.route:
        return "unmatched"
    return "/" + match.route


def _observe(request, response, started: float) -> None:
    method = request.method if request.method in _METHODS else "OTHER"
    route = _route(request)
    HTTP_REQUESTS.labels(method, route, str(response.status_code)).inc()
    HTTP_LATENCY.labels(method, route).observe(time.perf_counter() - started)


class _SyncAndAsyncMiddleware:
    """Runs in whichever mode the handler below it has, so an async view stays async end to end."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)


class RequestMetricsMiddleware(_SyncAndAsyncMiddleware):
    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        started = time.perf_counter()
        response = self.get_response(request)
        _observe(request, response, started)
        return response

    async def __acall__(self, request):
        started = time.perf_counter()
        response = await self.get_response(request)
        _observe(request, response, started)
        return response


def _is_api(request) -> bool:
    return request.path == "/v1" or request.path.startswith("/v1/")


def _reshaped(request, response):
    """An error page Django rendered itself for a /v1 request (a refused host, a body over the
    upload limit, a crash past a view's own handling) re-rendered in the API's JSON shape; and
    a request id on /v1 answers that did not pass through a view (the catch-all, those pages)."""
    if not _is_api(request):
        return response
    if not response.has_header("x-request-id"):
        response["x-request-id"] = new_request_id()
    if (
        response.status_code < 400
        or getattr(response, "streaming", False)
        or response.get("Content-Type", "").startswith("application/json")
    ):
        return response
    reshaped = error_response(error_for_status(response.status_code))
    for name in ("Allow", "Retry-After", "WWW-Authenticate", "x-request-id"):
        if response.has_header(name):
            reshaped[name] = response[name]
    return reshaped


class ApiErrorShapeMiddleware(_SyncAndAsyncMiddleware):
    """Every /v1 answer is JSON: exceptions a view lets escape become OpenAI-shaped errors (bad
    input a 4xx, anything else a logged 500), and so do error pages rendered below this layer."""

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return _reshaped(request, self.get_response(request))

    async def __acall__(self, request):
        return _reshaped(request, await self.get_response(request))

    def process_exception(self, request, exception):
        if not _is_api(request):
            return None
        return error_response(exception)


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise, able to run in an async chain. WhiteNoise's own middleware is sync only, and one
    sync middleware makes Django run the whole chain above it in a worker thread and hop back to
    the event loop for the async views below: two thread switches on every API request. Here a
    request for anything but a static file goes straight down the chain; a static file is served
    from a thread, as WhiteNoise serves it."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response=None, settings=None) -> None:
        from django.conf import settings as django_settings

        settings = settings or django_settings
        super().__init__(get_response, settings=settings)
        # Files outside the static prefix (WHITENOISE_ROOT) are looked up for every path.
        self.prefixed_only = not getattr(settings, "WHITENOISE_ROOT", None)
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request):
        if self.prefixed_only and not request.path_info.startswith(self.static_prefix):
            return await self.get_response(request)
        if self.autorefresh:
            static_file = await sync_to_async(self.find_file)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve)(static_file, request)
        return await self.get_response(request)


class _ApiLane:
    """For a Django MiddlewareMixin middleware: on /v1 paths its hooks either do not run at all
    (browser-only middleware: sessions, CSRF, login, messages, framing, CSP; the API authenticates
    by key and answers JSON) or run inline (`api_inline`: pure header and URL logic, no I/O).

    Under ASGI MiddlewareMixin runs each hook through a thread-sensitive sync_to_async: with a dozen
    such hooks an API request made a dozen thread hops, on a thread Django starts for each request.
    Pages keep the hooks exactly as Django runs them."""

    api_inline = False

    def __init__(self, get_response) -> None:
        super().__init__(get_response)
        if self.async_mode and hasattr(self, "process_view"):
            # Loaded into an async chain: a coroutine function, so Django does not wrap the hook in
            # a thread hop of its own; API views (csrf-exempt) skip it on the event loop.
            self._sync_process_view = self.process_view
            self.process_view = self._async_process_view

    async def _async_process_view(self, request, view_func, view_args, view_kwargs):
        if _is_api(request):
            return None
        return await sync_to_async(self._sync_process_view, thread_sensitive=True)(
            request, view_func, view_args, view_kwargs
        )

    def __call__(self, request):
        if not _is_api(request):
            return super().__call__(request)
        if not self.api_inline:
            return self.get_response(request)
        if self.async_mode:
            return self._api_acall(request)
        return super().__call__(request)

    async def _api_acall(self, request):
        response = self.process_request(request) if hasattr(self, "process_request") else None
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response


def _lane(path: str, *, inline: bool = False) -> type:
    from django.utils.module_loading import import_string

    base = import_string(path)
    return type(base.__name__, (_ApiLane, base), {"api_inline": inline, "__module__": __name__})


SecurityMiddleware = _lane("django.middleware.security.SecurityMiddleware", inline=True)
CommonMiddleware = _lane("django.middleware.common.CommonMiddleware", inline=True)
SessionMiddleware = _lane("django.contrib.sessions.middleware.SessionMiddleware")
CsrfViewMiddleware = _lane("django.middleware.csrf.CsrfViewMiddleware")
AuthenticationMiddleware = _lane("django.contrib.auth.middleware.AuthenticationMiddleware")
MessageMiddleware = _lane("django.contrib.messages.middleware.MessageMiddleware")
XFrameOptionsMiddleware = _lane("django.middleware.clickjacking.XFrameOptionsMiddleware")
CSPMiddleware = _lane("csp.middleware.CSPMiddleware")
