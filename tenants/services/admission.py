"""Admission for the serving path: model access, rate limits, concurrency and quota.

Reserve before a request is queued (prompt tokens + max_tokens), settle to the actual count when it
ends. Both are single atomic Redis scripts; settle happens at most once per request. The reservation
also keeps what its ledger row will say (tenants.services.settlements writes the row), so whoever
settles it, the process that admitted it or a settler after that process died, bills the same.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

import orjson
from django.utils import timezone

from core.errors import InvalidRequestError, model_not_found
from tenants.ratelimit import limiter
from tenants.selectors import quota_used_this_month
from tenants.types import AuthContext, LedgerEntry, Reservation, Settlement


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
        pass
    # First request of the month (or Redis lost the counters): the ledger is the truth. Both are
    # seeded (each only where missing), so that one retry finds what it needs.
    limiter.quota_counter_seed(
        tenant_id=auth.tenant_id, period=period, used=quota_used_this_month(tenant_id=auth.tenant_id)
    )
    if auth.key_monthly_token_budget is not None:
        limiter.key_budget_counter_seed(
            api_key_id=auth.api_key_id,
            period=period,
            used=quota_used_this_month(tenant_id=auth.tenant_id, api_key_id=auth.api_key_id),
        )
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
    ledger: LedgerEntry | None = None,
    owner: str = "",
    extra: dict[str, Any] | None = None,
) -> Reservation:
    """Reserve a generation's tokens, a concurrency slot and its quota, counting the request too
    unless `request_counted` (request_admit counted it before the prompt was tokenized).

    The reservation keeps `ledger` (the row's fields; by default just the model), the `owner` (the
    process that will settle it while it lives) and the caller's `extra` (JSON), which a settler
    reads back (settlement_list_open)."""
    model_access_check(auth=auth, model=model)
    tokens = _count("prompt_tokens", prompt_tokens) + _count("max_tokens", max_tokens)
    period = quota_period()
    meta = {
        "api_key_id": auth.api_key_id,
        "period": period,
        "ledger": asdict(ledger or LedgerEntry(model=model)),
        "owner": owner,
        "extra": extra or {},
    }
    headers = _admit_seeding_quota(
        auth=auth,
        period=period,
        request_id=request_id,
        tokens=tokens,
        take_slot=True,
        charge_quota=True,
        reserve=True,
        count_request=not request_counted,
        meta=orjson.dumps(meta).decode(),
    )
    return Reservation(
        request_id=request_id,
        tenant_id=auth.tenant_id,
        api_key_id=auth.api_key_id,
        reserved_tokens=tokens,
        ratelimit_headers=headers,
        quota_period=period,
    )


def settlement_encode(settlement: Settlement) -> str:
    return orjson.dumps(asdict(settlement)).decode()


def settlement_decode(raw: bytes | str) -> Settlement:
    return Settlement(**orjson.loads(raw))


def admission_settle(
    *, reservation: Reservation, settlement: Settlement, release_keys: list[str] = ()
) -> Settlement:
    """Charge the actual tokens instead of the reserved ones, free the slot and keep the settlement
    with the reservation until its ledger row is written (settlement_record). Once per request:
    returns the settlement that counts, this one or the one a first call stored. `release_keys`
    (Redis keys that only served to settle it) are deleted with it."""
    _count("prompt_tokens", settlement.prompt_tokens)
    _count("completion_tokens", settlement.completion_tokens)
    status, stored = limiter.settle(
        tenant_id=reservation.tenant_id,
        api_key_id=reservation.api_key_id,
        request_id=reservation.request_id,
        period=reservation.quota_period or quota_period(),
        actual_tokens=settlement.total_tokens,
        final=settlement_encode(settlement),
        release_keys=list(release_keys),
    )
    if status == limiter.SETTLED_BEFORE and stored is not None:
        return settlement_decode(stored)
    return settlement
