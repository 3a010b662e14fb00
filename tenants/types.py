"""Plain values handed from tenancy to the serving path (no ORM objects cross that line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True, slots=True)
class TenantLimitValues:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    monthly_token_quota: int | None = None
    fair_share_weight: int = 1
    service_tiers: tuple[str, ...] = ("default", "flex")
    max_queued_requests: int | None = None
    queue_timeout_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class AuthContext:
    """Who is calling, resolved from an API key. Cached per process; revocation is checked in Redis."""

    tenant_id: int
    tenant_slug: str
    api_key_id: int
    api_key_prefix: str
    tenant_limits: TenantLimitValues
    key_requests_per_minute: int | None = None
    key_tokens_per_minute: int | None = None
    # The key's list narrowed by the tenant's: what this caller may use, in the tenant's order.
    allowed_models: tuple[str, ...] = ()
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    tenant_id: int
    api_key_id: int
    reserved_tokens: int
    ratelimit_headers: dict[str, str] = field(default_factory=dict)
    # The month ("YYYY-MM") whose quota counter was charged, so a settle after midnight on the
    # last day corrects the right one.
    quota_period: str = ""
