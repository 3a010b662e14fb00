"""Admission for the serving path: model access, rate limits, concurrency and quota.

Reserve before a request is queued (prompt tokens + max_tokens), settle to the actual count when it
ends. Both are single atomic Redis scripts; settle happens at most once per request.
"""

from __future__ import annotations

import uuid

from django.utils import timezone

from core.errors import InvalidRequestError, model_not_found
from tenants.ratelimit import limiter
from tenants.selectors import quota_used_this_month
from tenants.types import AuthContext, Reservation


def quota_period(*, now=None) -> str:
    return (now or timezone.now()).strftime("%Y-%m")


def model_access_check(*, auth: AuthContext, model: str) -> None:
    if model not in auth.allowed_models:
        raise model_not_found(model)


def tenant_allowed_models(*, auth: AuthContext) -> list[str]:
    return list(auth.allowed_models)


def _admit_seeding_quota(*, auth: AuthContext, period: str, **kwargs) -> dict[str, str]:
    try:
        return limiter.admit(auth=auth, period=period, **kwargs)
    except limiter.QuotaCounterMissing:
        # First request of the month (or Redis lost the counter): the ledger is the truth.
        used = quota_used_this_month(tenant_id=auth.tenant_id)
        limiter.quota_counter_seed(tenant_id=auth.tenant_id, period=period, used=used)
        return limiter.admit(auth=auth, period=period, **kwargs)


def request_admit(*, auth: AuthContext, request_id: str | None = None) -> dict[str, str]:
    """Count a request that uses no tokens (e.g. GET /v1/usage) against the requests/min limits.

    Returns the x-ratelimit-* headers; raises RateLimitError (429) when over.
    """
    return limiter.admit(
        auth=auth,
        request_id=request_id or uuid.uuid4().hex,
        period=quota_period(),
        tokens=0,
        take_slot=False,
        charge_quota=False,
        reserve=False,
    )


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"{name} must be a non-negative integer.", param=name)
    return value


def admission_reserve(
    *,
    auth: AuthContext,
    model: str,
    prompt_tokens: int,
    max_tokens: int,
    request_id: str,
    request_counted: bool = False,
) -> Reservation:
    """Reserve a generation's tokens, a concurrency slot and its quota, counting the request too
    unless `request_counted` (request_admit counted it before the prompt was tokenized)."""
    model_access_check(auth=auth, model=model)
    tokens = _count("prompt_tokens", prompt_tokens) + _count("max_tokens", max_tokens)
    period = quota_period()
    headers = _admit_seeding_quota(
        auth=auth,
        period=period,
        request_id=request_id,
        tokens=tokens,
        take_slot=True,
        charge_quota=True,
        reserve=True,
        count_request=not request_counted,
    )
    return Reservation(
        request_id=request_id,
        tenant_id=auth.tenant_id,
        api_key_id=auth.api_key_id,
        reserved_tokens=tokens,
        ratelimit_headers=headers,
        quota_period=period,
    )


def admission_settle(*, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> None:
    """Charge the actual tokens instead of the reserved ones and free the slot. Idempotent."""
    limiter.settle(
        tenant_id=reservation.tenant_id,
        api_key_id=reservation.api_key_id,
        request_id=reservation.request_id,
        period=reservation.quota_period or quota_period(),
        actual_tokens=_count("prompt_tokens", prompt_tokens) + _count("completion_tokens", completion_tokens),
    )
