"""The one error hierarchy. Services raise these; the API layer renders them in OpenAI's shape:
{"error": {"message", "type", "param", "code"}} with the status and headers carried here.
"""

from __future__ import annotations


class PlatformError(Exception):
    status_code: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    default_message: str = "The server had an error while processing your request."

    def __init__(
        self,
        message: str | None = None,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.message = message or self.default_message
        if code is not None:
            self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        super().__init__(self.message)

    def as_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(PlatformError):
    status_code = 400
    type = "invalid_request_error"
    code = "invalid_request_error"
    default_message = "The request is invalid."


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"
    default_message = "The request exceeds the model's maximum context length."


class RequestTooLargeError(InvalidRequestError):
    status_code = 413
    code = "request_too_large"
    default_message = "The request body is larger than this server accepts."


class AuthenticationError(PlatformError):
    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    default_message = "Incorrect API key provided."


class PermissionDeniedError(PlatformError):
    status_code = 403
    type = "invalid_request_error"
    code = "permission_denied"
    default_message = "You are not allowed to perform this request."


class NotFoundError(PlatformError):
    status_code = 404
    type = "invalid_request_error"
    code = "not_found"
    default_message = "Not found."


class MethodNotAllowedError(PlatformError):
    status_code = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    default_message = "Method not allowed."


class RateLimitError(PlatformError):
    status_code = 429
    type = "requests"
    code = "rate_limit_exceeded"
    default_message = "Rate limit reached. Please try again later."

    def hold_s(self, most: float) -> float:
        """How long the answer waits before it is sent: its Retry-After, at most `most` seconds.

        A client that honours Retry-After loses nothing by it, since it would wait that long before
        trying again; one that ignores it and asks again at once is answered at most once per
        `most` seconds per connection, instead of as fast as the web process can refuse it, which
        is CPU the other tenants' requests need."""
        try:
            wait = (
                int(self.headers["retry-after-ms"]) / 1000
                if "retry-after-ms" in self.headers
                else float(self.headers.get("retry-after", most))
            )
        except ValueError:
            wait = most
        return max(0.0, min(wait, most))


class QuotaExceededError(PlatformError):
    status_code = 429
    type = "insufficient_quota"
    code = "insufficient_quota"
    default_message = "You exceeded your current quota for this month."

    def __init__(self, message: str | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        # Retrying cannot help until the quota is raised or the month turns.
        self.headers.setdefault("x-should-retry", "false")


class ServiceUnavailableError(PlatformError):
    status_code = 503
    type = "server_error"
    code = "service_unavailable"
    default_message = "The server is overloaded or not ready yet."


def model_not_found(model: str) -> NotFoundError:
    """The same error for a model that does not exist and one the caller may not use: a tenant
    must not learn which models other tenants are served."""
    return NotFoundError(
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )
