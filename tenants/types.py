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
    key_monthly_token_budget: int | None = None
    # The key's list narrowed by the tenant's: what this caller may use, in the tenant's order.
    allowed_models: tuple[str, ...] = ()
    expires_at: datetime | None = None
    # What the key may call (core.api.base.ApiView.required_scope): "inference", "manage".
    scopes: tuple[str, ...] = ("inference", "manage")


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


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """What a request's ledger row says besides its counts, fixed when it is admitted."""

    model: str
    adapter: str | None = None
    end_user: str = ""
    prompt_cache_key: str = ""
    service_tier: str = "default"
    batch_id: str = ""  # the Batch API batch the request is a line of
    price_factor: float = 1.0  # what a token costs here relative to an interactive one (batches: less)


@dataclass(frozen=True, slots=True)
class Settlement:
    """What a request is billed: its counts and outcome, decided once (see admission_settle)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    status: str = "success"  # success | error | cancelled
    time_to_first_token_ms: float | None = None
    latency_ms: float = 0.0
    finished_at: float = 0.0  # unix time; the ledger row's created_at

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class OpenSettlement:
    """A reservation whose ledger row is not written yet, as a settler finds it."""

    tenant_id: int
    request_id: str
    api_key_id: int
    quota_period: str
    reserved_tokens: int
    admitted_at: float  # unix time
    ledger: LedgerEntry
    owner: str  # the process that admitted it (it settles it while alive)
    extra: dict  # what the admitting app kept for itself
    final: Settlement | None  # settled, the ledger row still to write
    abandoned_at: float | None  # when a settler found its owner gone

    @property
    def reservation(self) -> Reservation:
        return Reservation(
            request_id=self.request_id,
            tenant_id=self.tenant_id,
            api_key_id=self.api_key_id,
            reserved_tokens=self.reserved_tokens,
            quota_period=self.quota_period,
        )
