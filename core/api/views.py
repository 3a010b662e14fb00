"""The /v1 catch-all: unknown API routes answer in the API's error shape, never with an HTML page."""

from __future__ import annotations

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from core.api.exceptions import error_response
from core.errors import NotFoundError


@csrf_exempt
def v1_not_found(request, *args, **kwargs) -> JsonResponse:
    return error_response(
        NotFoundError(f"Invalid URL ({request.method} {request.path}).", code="unknown_url")
    )
