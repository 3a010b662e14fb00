"""Every API error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

`error_response` is the one renderer: the /v1 views (core.api.base.ApiView), the /v1 catch-all and
the middleware that guarantees JSON on /v1 all answer errors through it.
"""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings
from django.core.exceptions import BadRequest, PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.db import InterfaceError as DatabaseInterfaceError
from django.db import OperationalError as DatabaseOperationalError
from django.http import Http404, JsonResponse
from django.http.multipartparser import MultiPartParserError
from rest_framework import exceptions as drf

from core.errors import (
    AuthenticationError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PermissionDeniedError,
    PlatformError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
)
from core.redis_client import REDIS_CONNECTION_ERRORS

logger = logging.getLogger(__name__)

# A dependency that is down (Redis, PostgreSQL): the client should retry after this many seconds.
DEPENDENCY_RETRY_AFTER_S = 5


def _first_error(detail, path: str = "") -> tuple[str | None, str, str]:
    """(param, message, code) of the first error in a DRF ValidationError detail."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = path if key == "non_field_errors" else (f"{path}.{key}" if path else str(key))
            return _first_error(value, name)
    if isinstance(detail, list):
        for index, value in enumerate(detail):
            if isinstance(value, dict | list):
                return _first_error(value, f"{path}[{index}]" if path else str(index))
            return _first_error(value, path)
    code = getattr(detail, "code", None) or "invalid"
    return (path or None), str(detail), str(code)


def _message_of(exc: drf.APIException) -> str:
    detail = exc.detail
    if isinstance(detail, list | dict):
        return _first_error(detail)[1]
    return str(detail)


def to_platform_error(exc: Exception) -> PlatformError | None:
    """Translate DRF's and Django's exceptions into the one hierarchy (None: not ours to handle)."""
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, drf.ValidationError):
        param, message, code = _first_error(exc.detail)
        return InvalidRequestError(message, param=param, code=code)
    if isinstance(exc, drf.ParseError):
        return InvalidRequestError(
            f"We could not parse the JSON body of your request. ({_message_of(exc)})", code="invalid_json"
        )
    if isinstance(exc, drf.UnsupportedMediaType):
        return InvalidRequestError(_message_of(exc), code="unsupported_media_type")
    if isinstance(exc, drf.NotAcceptable):
        return InvalidRequestError(_message_of(exc), code="not_acceptable")
    if isinstance(exc, drf.NotAuthenticated | drf.AuthenticationFailed):
        return AuthenticationError(_message_of(exc))
    if isinstance(exc, drf.PermissionDenied | PermissionDenied):
        return PermissionDeniedError(str(getattr(exc, "detail", "")) or None)
    if isinstance(exc, drf.NotFound | Http404):
        return NotFoundError(str(getattr(exc, "detail", "")) or None)
    if isinstance(exc, drf.MethodNotAllowed):
        return MethodNotAllowedError(_message_of(exc))
    if isinstance(exc, drf.Throttled):
        wait = exc.wait or 1
        return RateLimitError(_message_of(exc), headers={"retry-after": str(int(wait) or 1)})
    if isinstance(exc, RequestDataTooBig):
        return RequestTooLargeError(
            f"The request body is larger than the {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes this server accepts."
        )
    if isinstance(exc, MultiPartParserError):
        return InvalidRequestError(
            f"The multipart body could not be parsed. ({exc})", code="invalid_multipart"
        )
    if isinstance(exc, SuspiciousOperation | BadRequest):
        return InvalidRequestError("The request was refused as malformed.", code="bad_request")
    if isinstance(exc, drf.APIException):
        error = PlatformError(_message_of(exc), code=str(exc.default_code))
        error.status_code = exc.status_code
        return error
    if isinstance(exc, (*REDIS_CONNECTION_ERRORS, DatabaseOperationalError, DatabaseInterfaceError)):
        # Logged once per outage by whatever watches the dependency, not once per request.
        what = "queue" if isinstance(exc, REDIS_CONNECTION_ERRORS) else "database"
        return ServiceUnavailableError(
            f"The service is temporarily unavailable (its {what} cannot be reached). Please retry "
            f"in {DEPENDENCY_RETRY_AFTER_S} seconds.",
            headers={"retry-after": str(DEPENDENCY_RETRY_AFTER_S)},
        )
    return None


_ERRORS_BY_STATUS: dict[int, type[PlatformError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    413: RequestTooLargeError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def error_for_status(status: int) -> PlatformError:
    """The platform's error for a bare HTTP status (pages rendered outside the API's views)."""
    error_class = _ERRORS_BY_STATUS.get(status)
    if error_class is not None:
        return error_class()
    error = PlatformError() if status >= 500 else InvalidRequestError()
    error.status_code = status
    return error


def platform_error_of(exc: Exception) -> PlatformError:
    """`exc` as a platform error. Anything that is not a platform, DRF or Django request error is
    a bug: logged, and answered as a 500 that reveals nothing."""
    error = to_platform_error(exc)
    if error is None:
        logger.exception("unhandled error", exc_info=exc)
        error = PlatformError()
    return error


async def refusal_held(exc: Exception) -> None:
    """Wait out a rate limit's refusal before it is answered (RateLimitError.hold_s, at most
    RATE_LIMIT_HOLD_S), on the REST API and the websocket alike; any other error goes at once."""
    if isinstance(exc, RateLimitError):
        await asyncio.sleep(exc.hold_s(settings.RATE_LIMIT_HOLD_S))


def error_response(exc: Exception) -> JsonResponse:
    """`exc` in OpenAI's error shape, with its status and headers."""
    error = platform_error_of(exc)
    response = JsonResponse(error.as_body(), status=error.status_code)
    for name, value in error.headers.items():
        response[name] = value
    if error.status_code == 401:
        response["WWW-Authenticate"] = 'Bearer realm="api"'
    return response
