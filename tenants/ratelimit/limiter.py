"""Redis side of admission: run the Lua scripts and translate their answers into headers/errors.

All checks and all counting happen inside one script call (one round trip, atomic), so two web
processes can never both take the last slot.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from redis.commands.core import Script

from core.errors import InvalidRequestError, QuotaExceededError, RateLimitError
from core.redis_client import get_redis, rkey
from tenants.types import AuthContext

WINDOW_SECONDS = 60
_HERE = Path(__file__).resolve().parent

OK, RATE_LIMITED, TOO_MANY_CONCURRENT, QUOTA_EXCEEDED, QUOTA_UNSEEDED, DUPLICATE, TOO_LARGE = (
    1,
    0,
    2,
    3,
    4,
    5,
    6,
)
KEY_BUDGET_UNSEEDED, KEY_BUDGET_EXCEEDED = 7, 8


@functools.cache
def _script(name: str) -> Script:
    return get_redis().register_script((_HERE / name).read_text())


def _setting(name: str, default: int) -> int:
    return int(getattr(settings, name, default))


class QuotaCounterMissing(Exception):
    """The month's quota counter (`scope` "tenant"), or the key's budget counter ("key"), is not
    in Redis: seed it from the ledger and try again."""

    def __init__(self, scope: str = "tenant") -> None:
        super().__init__(scope)
        self.scope = scope


@dataclass(frozen=True, slots=True)
class Keys:
    tenant_id: int
    api_key_id: int

    def tokens(self, scope: str, ident: int) -> list[str]:
        return [rkey("rl", "tok", scope, ident, part) for part in ("log", "amt", "sum")]

    def admit(self, *, period: str, request_id: str) -> list[str]:
        return [
            rkey("rl", "req", "key", self.api_key_id),
            rkey("rl", "req", "tenant", self.tenant_id),
            *self.tokens("key", self.api_key_id),
            *self.tokens("tenant", self.tenant_id),
            self.in_flight(),
            self.quota(period),
            self.reservation(request_id),
            open_settlements_key(),
            self.key_budget(period),
        ]

    def settle(self, *, period: str, request_id: str) -> list[str]:
        key_log, key_amt, key_sum = self.tokens("key", self.api_key_id)
        tenant_log, tenant_amt, tenant_sum = self.tokens("tenant", self.tenant_id)
        return [
            self.reservation(request_id),
            key_amt,
            key_sum,
            tenant_amt,
            tenant_sum,
            self.in_flight(),
            self.quota(period),
            self.key_budget(period),
        ]

    def in_flight(self) -> str:
        return rkey("conc", self.tenant_id)

    def quota(self, period: str) -> str:
        return rkey("quota", self.tenant_id, period)

    def key_budget(self, period: str) -> str:
        return rkey("quota", "key", self.api_key_id, period)

    def reservation(self, request_id: str) -> str:
        return rkey("resv", self.tenant_id, request_id)

    def open_member(self, request_id: str) -> str:
        return f"{self.tenant_id}:{request_id}"


def open_settlements_key() -> str:
    """A sorted set of the reservations whose ledger row is not written yet ("tenant_id:request_id"),
    scored by admission time."""
    return rkey("settle", "open")


def format_duration(milliseconds: int) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if milliseconds < 1000:
        return f"{max(milliseconds, 0)}ms"
    seconds = milliseconds / 1000
    if seconds < 60:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_text}s"


def _headers(reply: list) -> dict[str, str]:
    req_limit, req_remaining, req_reset, tok_limit, tok_remaining, tok_reset = (int(v) for v in reply[1:7])
    headers: dict[str, str] = {}
    if req_limit >= 0:
        headers["x-ratelimit-limit-requests"] = str(req_limit)
        headers["x-ratelimit-remaining-requests"] = str(max(req_remaining, 0))
        headers["x-ratelimit-reset-requests"] = format_duration(req_reset)
    if tok_limit >= 0:
        headers["x-ratelimit-limit-tokens"] = str(tok_limit)
        headers["x-ratelimit-remaining-tokens"] = str(max(tok_remaining, 0))
        headers["x-ratelimit-reset-tokens"] = format_duration(tok_reset)
    return headers


def _limit(value: int | None) -> int:
    return -1 if value is None else int(value)


def admit(
    *,
    auth: AuthContext,
    request_id: str,
    period: str,
    tokens: int,
    take_slot: bool,
    charge_quota: bool,
    reserve: bool,
    count_request: bool = True,
    meta: str = "",
) -> dict[str, str]:
    """Count one request (and `tokens`) against every limit, or raise without counting anything.
    count_request=False: the request was counted already (request_admit); only tokens, slot and
    quota are checked and taken here.

    `meta` (JSON) is kept with the reservation for whoever settles it (see settle.lua).

    Returns the x-ratelimit-* headers. Raises QuotaCounterMissing when the month's counter must be
    seeded first.
    """
    limits = auth.tenant_limits
    keys = Keys(tenant_id=auth.tenant_id, api_key_id=auth.api_key_id)
    args = [
        WINDOW_SECONDS,
        request_id,
        1 if count_request else 0,
        tokens,
        _limit(auth.key_requests_per_minute),
        _limit(limits.requests_per_minute),
        _limit(auth.key_tokens_per_minute),
        _limit(limits.tokens_per_minute),
        _limit(limits.max_concurrent_requests) if take_slot else -1,
        _limit(limits.monthly_token_quota) if charge_quota else -1,
        40 * 24 * 3600,  # a month's counter outlives the month, then goes
        _setting("TENANT_CONCURRENCY_LEASE_SECONDS", 900),
        _setting("TENANT_RESERVATION_TTL_SECONDS", 24 * 3600) if reserve else 0,
        meta,
        keys.open_member(request_id),
        _limit(auth.key_monthly_token_budget) if charge_quota else -1,
    ]
    reply = _script("admit.lua")(keys=keys.admit(period=period, request_id=request_id), args=args)
    status = int(reply[0])
    headers = _headers(reply)
    if status == OK:
        return headers
    if status == QUOTA_UNSEEDED:
        raise QuotaCounterMissing()
    if status == KEY_BUDGET_UNSEEDED:
        raise QuotaCounterMissing("key")
    if status == DUPLICATE:
        raise InvalidRequestError("This request id is already in flight.", code="duplicate_request_id")
    scope = reply[8].decode() if isinstance(reply[8], bytes) else str(reply[8])
    if status == QUOTA_EXCEEDED:
        raise QuotaExceededError(
            "You exceeded your current quota: the monthly token quota is used up.", headers=headers
        )
    if status == KEY_BUDGET_EXCEEDED:
        raise QuotaExceededError(
            "This API key's monthly token budget is used up: it takes more requests next month, or "
            "once its budget is raised.",
            headers=headers,
        )
    retry_seconds = max(1, math.ceil(int(reply[7]) / 1000))
    headers["retry-after"] = str(retry_seconds)
    headers["retry-after-ms"] = str(int(reply[7]))
    if status == TOO_LARGE:
        message = f"Request too large: {tokens} tokens exceed the {scope} limit."
    elif status == TOO_MANY_CONCURRENT:
        message = f"Rate limit reached for {scope}. Please try again when a request finishes."
    else:
        message = f"Rate limit reached for {scope}. Please try again in {retry_seconds}s."
    _count_refusal(tenant_id=auth.tenant_id)
    raise RateLimitError(message, headers=headers)


# Refusals by a rate limit are counted per tenant and hour, for the alert on limits hit repeatedly
# (tenants.services.alerts); kept two hours.
def rate_limited_key(*, tenant_id: int, hour: str) -> str:
    return rkey("alerts", "ratelimited", tenant_id, hour)


def _count_refusal(*, tenant_id: int) -> None:
    key = rate_limited_key(tenant_id=tenant_id, hour=time.strftime("%Y-%m-%dT%H", time.gmtime()))
    pipe = get_redis().pipeline(transaction=False)
    pipe.incr(key)
    pipe.expire(key, 2 * 3600)
    pipe.execute()


def rate_limited_count(*, tenant_id: int, hour: str) -> int:
    return int(get_redis().get(rate_limited_key(tenant_id=tenant_id, hour=hour)) or 0)


SETTLED_NOW, SETTLED_BEFORE, NOT_RESERVED = 1, 2, 0


def settle(
    *,
    tenant_id: int,
    api_key_id: int,
    request_id: str,
    period: str,
    actual_tokens: int,
    final: str,
    release_keys: list[str] = (),
) -> tuple[int, bytes | None]:
    """Correct the counters to `actual_tokens` and store `final` (JSON), once. Returns SETTLED_NOW,
    SETTLED_BEFORE with the settlement stored then, or NOT_RESERVED. `release_keys` are deleted
    with it."""
    keys = Keys(tenant_id=tenant_id, api_key_id=api_key_id)
    reply = _script("settle.lua")(
        keys=[*keys.settle(period=period, request_id=request_id), *release_keys],
        args=[request_id, actual_tokens, final],
    )
    return int(reply[0]), (reply[1] if len(reply) > 1 else None)


def quota_counter_seed(*, tenant_id: int, period: str, used: int) -> None:
    """Create the month's counter from the ledger, unless another process got there first."""
    get_redis().set(Keys(tenant_id=tenant_id, api_key_id=0).quota(period), used, nx=True, ex=40 * 24 * 3600)


def key_budget_counter_seed(*, api_key_id: int, period: str, used: int) -> None:
    """Create the key's month counter from the ledger, unless another process got there first."""
    get_redis().set(
        Keys(tenant_id=0, api_key_id=api_key_id).key_budget(period), used, nx=True, ex=40 * 24 * 3600
    )


def key_budget_counter_value(*, api_key_id: int, period: str) -> int | None:
    value = get_redis().get(Keys(tenant_id=0, api_key_id=api_key_id).key_budget(period))
    return None if value is None else int(value)


def quota_counter_value(*, tenant_id: int, period: str) -> int | None:
    value = get_redis().get(Keys(tenant_id=tenant_id, api_key_id=0).quota(period))
    return None if value is None else int(value)


def in_flight_count(*, tenant_id: int) -> int:
    return int(get_redis().zcard(Keys(tenant_id=tenant_id, api_key_id=0).in_flight()))
