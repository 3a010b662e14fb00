"""Prometheus request metrics by route (the URL pattern, never the raw path: bounded labels)."""

from __future__ import annotations

import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from prometheus_client import Counter, Histogram

HTTP_REQUESTS = Counter(
    "pagoda_http_requests_total", "HTTP requests handled", ["method", "route", "status"]
)
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


class RequestMetricsMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

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
