"""API keys: creation (secret shown once), revocation, and authentication of a raw key.

A key reads `sk-<prefix>_<secret>`. The database keeps the prefix (for lookup, and to show) and an
HMAC-SHA256 digest of the whole key under settings.API_KEY_PEPPER, never the key itself.

Resolved keys are cached per process for API_KEY_CACHE_SECONDS. Every authentication still makes
one Redis round trip to read the auth epoch, a counter bumped after every revocation or limit
change: a process holding a cached context from an older epoch resolves the key again, so a
revocation is seen by every process on its next request, not after the cache expires.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError
from core.redis_client import get_redis, rkey
from tenants.models import ApiKey, Tenant, TenantLimits
from tenants.services.audit import audit_record, audit_snapshot
from tenants.types import AuthContext, TenantLimitValues

_KEY_RE = re.compile(r"^sk-([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_CACHE_MAX_ENTRIES = 10_000
_LAST_USED_EVERY_SECONDS = 60


def _epoch_key() -> str:
    return rkey("auth", "epoch")


def api_key_digest(*, raw_key: str) -> str:
    return hmac.new(settings.API_KEY_PEPPER.encode(), raw_key.encode(), hashlib.sha256).hexdigest()


def auth_cache_invalidate() -> None:
    """Make every process re-resolve keys on their next use (after a revocation or limit change)."""
    get_redis().incr(_epoch_key())


def _invalidate_on_commit() -> None:
    # After commit: a process that re-resolves the key must already read the new row.
    transaction.on_commit(auth_cache_invalidate)


def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    created_by=None,
    expires_at: datetime | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    allowed_models: list[str] | None = None,
    scope: str = ApiKey.Scope.ALL,
    monthly_token_budget: int | None = None,
) -> tuple[ApiKey, str]:
    """Create a key; returns it with the raw secret, which exists nowhere else afterwards."""
    if scope not in ApiKey.Scope.values:
        raise InvalidRequestError(
            f"Unknown key scope {scope!r}: use one of {', '.join(ApiKey.Scope.values)}."
        )
    for _attempt in range(5):
        prefix = secrets.token_hex(6)
        raw_key = _raw_key(prefix)
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    tenant=tenant,
                    name=name,
                    created_by=created_by,
                    expires_at=expires_at,
                    prefix=prefix,
                    digest=api_key_digest(raw_key=raw_key),
                    requests_per_minute=requests_per_minute,
                    tokens_per_minute=tokens_per_minute,
                    allowed_models=allowed_models,
                    scope=scope,
                    monthly_token_budget=monthly_token_budget,
                )
                audit_record(action="create", obj=api_key, tenant_id=tenant.pk, after=audit_snapshot(api_key))
        except IntegrityError:
            continue  # a prefix collision (48 random bits): draw again
        return api_key, raw_key
    raise RuntimeError("could not draw a unique API key prefix")


def _raw_key(prefix: str) -> str:
    return f"sk-{prefix}_{secrets.token_urlsafe(32)}"


# How long the secret a rotation replaces stays valid, unless the caller says otherwise.
ROTATION_GRACE_DEFAULT = timedelta(hours=24)


def api_key_rotate(*, api_key: ApiKey, grace: timedelta = ROTATION_GRACE_DEFAULT) -> tuple[ApiKey, str]:
    """Give the key a new secret (same prefix, limits, scope and ledger) and keep the current one
    valid for `grace` (none: invalid at once). A secret an earlier rotation kept is dropped.
    Returns the key and its new raw secret, which exists nowhere else afterwards."""
    if grace < timedelta(0):
        raise InvalidRequestError("The grace period of a rotation cannot be negative.")
    raw_key = _raw_key(api_key.prefix)
    now = timezone.now()
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().get(pk=api_key.pk)
        if locked.is_revoked:
            raise InvalidRequestError("A revoked key cannot be rotated.", code="api_key_revoked")
        if locked.is_expired:
            raise InvalidRequestError("An expired key cannot be rotated.", code="api_key_expired")
        keep_old = grace > timedelta(0)
        before = audit_snapshot(locked, fields=["previous_valid_until"])
        locked.previous_digest = locked.digest if keep_old else ""
        locked.previous_valid_until = now + grace if keep_old else None
        locked.digest = api_key_digest(raw_key=raw_key)
        locked.save(update_fields=["digest", "previous_digest", "previous_valid_until"])
        audit_record(
            action="rotate",
            obj=locked,
            tenant_id=locked.tenant_id,
            before=before,
            after=audit_snapshot(locked, fields=["previous_valid_until"]),
        )
        _invalidate_on_commit()
    return locked, raw_key


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke once (revoking again keeps the first time). Takes effect everywhere at once."""
    with transaction.atomic():
        revoked = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        api_key.refresh_from_db(fields=["revoked_at"])
        if revoked:
            audit_record(
                action="revoke",
                obj=api_key,
                tenant_id=api_key.tenant_id,
                before={"revoked_at": None},
                after=audit_snapshot(api_key, fields=["revoked_at"]),
            )
        _invalidate_on_commit()
    return api_key


# --- authentication ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Secrets:
    """The digests a key accepts: its secret's, and until `previous_until` the one a rotation replaced."""

    digest: str
    previous: str = ""
    previous_until: datetime | None = None

    def match(self, digest: str) -> str | None:
        """Which secret the digest is of: "current", "previous", or None for neither."""
        if hmac.compare_digest(self.digest, digest):
            return "current"
        if self.previous and hmac.compare_digest(self.previous, digest):
            return "previous"
        return None

    def rotated_out(self, digest: str, now: datetime) -> bool:
        """Whether the digest is of the secret a rotation replaced and its grace period is over."""
        in_grace = self.previous_until is not None and now < self.previous_until
        return not in_grace and self.match(digest) == "previous"


@dataclass(frozen=True, slots=True)
class _Cached:
    context: AuthContext
    secrets: _Secrets
    epoch: bytes | None
    stored_at: float


_cache: dict[str, _Cached] = {}
_cache_lock = threading.Lock()


def _context_from_row(api_key: ApiKey) -> AuthContext:
    try:
        limits = api_key.tenant.limits
    except TenantLimits.DoesNotExist:
        # Unsaved: the default limits, no models.
        limits = TenantLimits(tenant=api_key.tenant, **settings.TENANT_DEFAULT_LIMITS)
    tenant_models = [m for m in (limits.allowed_models or []) if isinstance(m, str)]
    if api_key.allowed_models is None:
        allowed = tenant_models
    else:
        # A key can narrow its tenant's models, never widen them.
        allowed = [m for m in tenant_models if m in set(api_key.allowed_models)]
    return AuthContext(
        tenant_id=api_key.tenant_id,
        tenant_slug=api_key.tenant.slug,
        api_key_id=api_key.pk,
        api_key_prefix=api_key.display_prefix,
        tenant_limits=TenantLimitValues(
            requests_per_minute=limits.requests_per_minute,
            tokens_per_minute=limits.tokens_per_minute,
            max_concurrent_requests=limits.max_concurrent_requests,
            monthly_token_quota=limits.monthly_token_quota,
            fair_share_weight=limits.fair_share_weight,
            service_tiers=tuple(t for t in (limits.service_tiers or []) if isinstance(t, str)),
            max_queued_requests=limits.max_queued_requests,
            queue_timeout_seconds=limits.queue_timeout_seconds,
        ),
        key_requests_per_minute=api_key.requests_per_minute,
        key_tokens_per_minute=api_key.tokens_per_minute,
        key_monthly_token_budget=api_key.monthly_token_budget,
        allowed_models=tuple(allowed),
        expires_at=api_key.expires_at,
        scopes=("inference",) if api_key.scope == ApiKey.Scope.INFERENCE else ("inference", "manage"),
    )


def _invalid(raw_key: str) -> AuthenticationError:
    shown = f"{raw_key[:7]}...{raw_key[-4:]}" if len(raw_key) > 14 else "***"
    return AuthenticationError(f"Incorrect API key provided: {shown}.")


def _resolve(*, prefix: str, digest: str, raw_key: str) -> tuple[AuthContext, _Secrets]:
    api_key = ApiKey.objects.select_related("tenant", "tenant__limits").filter(prefix=prefix).first()
    if api_key is None:
        raise _invalid(raw_key)
    accepted = _Secrets(api_key.digest, api_key.previous_digest, api_key.previous_valid_until)
    if accepted.match(digest) is None:
        raise _invalid(raw_key)
    if api_key.revoked_at is not None:
        raise AuthenticationError("This API key has been revoked.")
    if not api_key.tenant.active:
        raise PermissionDeniedError("This organization is not active.", code="tenant_inactive")
    return _context_from_row(api_key), accepted


def _touch_last_used(api_key_id: int) -> None:
    ApiKey.objects.filter(pk=api_key_id).update(last_used_at=timezone.now())


def api_key_authenticate(*, raw_key: str) -> AuthContext:
    """Resolve a raw key to its AuthContext, or raise AuthenticationError (401)."""
    match = _KEY_RE.match(raw_key or "")
    if match is None:
        raise _invalid(raw_key or "")
    prefix = match.group(1)
    digest = api_key_digest(raw_key=raw_key)
    client = get_redis()
    last_used_key = rkey("auth", "used", prefix)
    cached = _cache.get(prefix)
    ttl = float(getattr(settings, "API_KEY_CACHE_SECONDS", 30))
    if cached and time.monotonic() - cached.stored_at < ttl and cached.secrets.match(digest):
        # One round trip: the epoch check plus the at-most-once-a-minute last-used guard.
        pipe = client.pipeline(transaction=False)
        pipe.get(_epoch_key())
        pipe.set(last_used_key, 1, nx=True, ex=_LAST_USED_EVERY_SECONDS)
        epoch, first_use_this_minute = pipe.execute()
        context = cached.context if epoch == cached.epoch else None
    else:
        epoch, context, first_use_this_minute = client.get(_epoch_key()), None, None
    if context is None:
        # The epoch was read before the row: a revocation committed after this read bumps the
        # epoch past the one cached here, so the next request resolves again.
        context, accepted = _resolve(prefix=prefix, digest=digest, raw_key=raw_key)
        with _cache_lock:
            if len(_cache) >= _CACHE_MAX_ENTRIES:
                _cache.clear()
            _cache[prefix] = cached = _Cached(context, accepted, epoch, time.monotonic())
        if first_use_this_minute is None:
            first_use_this_minute = client.set(last_used_key, 1, nx=True, ex=_LAST_USED_EVERY_SECONDS)
    now = timezone.now()
    if context.expires_at is not None and context.expires_at <= now:
        raise AuthenticationError("This API key has expired.")
    # The secret a rotation replaced ends at its time in every process, cached or not.
    assert cached is not None
    if cached.secrets.rotated_out(digest, now):
        raise AuthenticationError("This API key's secret was rotated and its grace period is over.")
    if first_use_this_minute:
        _touch_last_used(context.api_key_id)
    return context


def api_key_context(*, api_key_id: int) -> AuthContext:
    """The AuthContext of a stored key, for work it started that runs later (a batch's lines):
    AuthenticationError once the key is revoked or expired, as its next request would get."""
    api_key = ApiKey.objects.select_related("tenant", "tenant__limits").filter(pk=api_key_id).first()
    if api_key is None or api_key.is_revoked:
        raise AuthenticationError(
            "The API key that created this work has been revoked.", code="invalid_api_key"
        )
    if api_key.is_expired:
        raise AuthenticationError("The API key that created this work has expired.")
    return _context_from_row(api_key)


def api_key_authenticate_header(*, authorization: str | None) -> AuthContext:
    """The AuthContext of an `Authorization: Bearer <key>` header value, or AuthenticationError."""
    return api_key_authenticate(raw_key=bearer_token(authorization=authorization))


def bearer_token(*, authorization: str | None) -> str:
    """The key from an `Authorization: Bearer <key>` header value, or AuthenticationError."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError(
            "You didn't provide an API key. Send it in the Authorization header as 'Bearer YOUR_KEY'."
        )
    return token.strip()
