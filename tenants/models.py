"""Tenancy: tenants, their members, limits and API keys, and the usage ledger with its daily roll-up.

Models stay thin: fields, constraints and one-row properties. Behaviour lives in services/selectors.
"""

from __future__ import annotations

import secrets
from decimal import Decimal

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone


def default_service_tiers() -> list[str]:
    return ["default", "flex"]


def validate_service_tiers(value: object) -> None:
    from django.core.exceptions import ValidationError

    from engine.rules import SERVICE_TIER_PRIORITY

    if not isinstance(value, list) or any(t not in SERVICE_TIER_PRIORITY for t in value):
        raise ValidationError(f"A list of service tiers, each one of {', '.join(SERVICE_TIER_PRIORITY)}.")


class Tenant(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.slug


class TenantLimits(models.Model):
    """Per-tenant limits. A null rate field means unlimited; an empty model list means no model."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="limits")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_quota = models.PositiveBigIntegerField(null=True, blank=True)
    allowed_models = models.JSONField(
        default=list, blank=True, help_text="Served model names this tenant may call. Empty: none."
    )
    fair_share_weight = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text="This tenant's share of an engine when tenants contend for it: weight 2 is served "
        "twice as much as weight 1.",
    )
    service_tiers = models.JSONField(
        default=default_service_tiers,
        blank=True,
        validators=[validate_service_tiers],
        help_text='Service tiers this tenant may ask for: any of "default", "flex", "priority". '
        '"auto" (or no tier) means default.',
    )
    max_queued_requests = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Requests of this tenant waiting to start on one model; beyond it a 429. Empty: unlimited.",
    )
    queue_timeout_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="A request that has not started after this long is dropped with an error, billed "
        "nothing. Empty: only the client's own timeout applies.",
    )

    class Meta:
        verbose_name_plural = "tenant limits"

    def __str__(self) -> str:
        return f"limits of {self.tenant_id}"


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        ADMIN = "admin", "Admin"
        MEMBER = "member", "Member"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant_unique")
        ]

    def __str__(self) -> str:
        return f"{self.user_id}@{self.tenant_id} ({self.role})"


class ApiKey(models.Model):
    """An API key. Only the lookup prefix and an HMAC digest of the secret are kept."""

    class Scope(models.TextChoices):
        ALL = "all", "Inference and management (adapters, files, batches, usage)"
        INFERENCE = "inference", "Inference only"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    prefix = models.CharField(max_length=32, unique=True, editable=False)
    digest = models.CharField(max_length=64, editable=False)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    allowed_models = models.JSONField(
        null=True, blank=True, help_text="Null: inherit the tenant's models. A list narrows them."
    )
    monthly_token_budget = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Tokens this key may use per calendar month (UTC), under the tenant's quota. Empty: "
        "only the tenant's quota applies.",
    )
    scope = models.CharField(
        max_length=16,
        choices=Scope.choices,
        default=Scope.ALL,
        help_text="What the key may call: inference only, or inference and the management endpoints.",
    )
    # A rotation's overlap: the secret before the last rotation stays valid until then.
    previous_digest = models.CharField(max_length=64, blank=True, default="", editable=False)
    previous_valid_until = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.display_prefix})"

    @property
    def display_prefix(self) -> str:
        return f"sk-{self.prefix}"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def previous_secret_valid(self) -> bool:
        return bool(self.previous_digest) and (
            self.previous_valid_until is not None and self.previous_valid_until > timezone.now()
        )


class UsageRecord(models.Model):
    """Append-only ledger: exactly one row per request. Never holds prompt or output text."""

    class Status(models.TextChoices):
        SUCCESS = "success", "Success"
        ERROR = "error", "Error"
        CANCELLED = "cancelled", "Cancelled"

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_records")
    # PROTECT: keys are revoked, never deleted, while the ledger refers to them.
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_records")
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, null=True, blank=True)
    prompt_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField(default=0)
    time_to_first_token_ms = models.FloatField(null=True, blank=True)
    latency_ms = models.FloatField()
    status = models.CharField(max_length=16, choices=Status.choices)
    # The caller's own identifiers, as the request carried them (OpenAI's safety_identifier, or the
    # older `user`; prompt_cache_key): opaque ids for the tenant's reports, never text.
    end_user = models.CharField(max_length=64, blank=True, default="")
    prompt_cache_key = models.CharField(max_length=64, blank=True, default="")
    # The service tier the request ran on (default, flex, priority).
    service_tier = models.CharField(max_length=16, blank=True, default="default")
    # A Batch API line: its batch, and the price factor it is billed at (BATCH_PRICE_FACTOR; 1 for
    # interactive requests). Billed tokens are total_tokens x price_factor.
    batch_id = models.CharField(max_length=64, blank=True, default="", db_index=True)
    price_factor = models.DecimalField(max_digits=5, decimal_places=3, default=Decimal("1"))
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "created_at"], name="usage_tenant_created_idx")]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageDaily(models.Model):
    """Daily aggregates of the ledger, recomputed by `usage_rollup` (an idempotent upsert)."""

    day = models.DateField()
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_daily")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_daily")
    model = models.CharField(max_length=200)
    # "" rather than NULL for "no adapter": NULLs never conflict in a unique index, which would
    # break the upsert.
    adapter = models.CharField(max_length=200, blank=True, default="")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-day", "tenant_id", "model"]
        verbose_name_plural = "usage daily"
        constraints = [
            models.UniqueConstraint(
                fields=["day", "tenant", "api_key", "model", "adapter"], name="usage_daily_bucket_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.tenant_id} {self.model}"


class AuditEntryQuerySet(models.QuerySet):
    """Append-only: rows are never changed, and removed only by the retention purge."""

    def update(self, **kwargs):
        raise TypeError("audit entries are append-only: they cannot be updated")

    def delete(self):
        raise TypeError("audit entries are append-only: only the retention purge removes them")

    def purge(self) -> int:
        """Delete these rows (the retention purge, tenants.services.audit_purge, only)."""
        return models.QuerySet.delete(self)[0]


class AuditEntry(models.Model):
    """One change made by a person or a key: who, when, from where, to what, and the fields before
    and after. Written by tenants.services.audit_record; never changed afterwards."""

    class Source(models.TextChoices):
        ADMIN = "admin", "Admin"
        DASHBOARD = "dashboard", "Dashboard"
        API = "api", "API"
        SYSTEM = "system", "System"

    created_at = models.DateTimeField(default=timezone.now, editable=False, db_index=True)
    # SET_NULL and a copy of the slug: the trail outlives what it is about.
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    tenant_slug = models.CharField(max_length=64, blank=True)
    source = models.CharField(max_length=16, choices=Source.choices)
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor = models.CharField(max_length=200, help_text="The username, or the key's prefix, when it acted.")
    address = models.GenericIPAddressField(null=True, blank=True)
    action = models.CharField(max_length=32)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=200)
    # {field: [before, after]}; a creation has null befores, a deletion null afters.
    changes = models.JSONField(default=dict)

    objects = AuditEntryQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["tenant", "created_at"], name="audit_tenant_created_idx")]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_type} {self.object_repr}"

    def save(self, *args, **kwargs) -> None:
        if not self._state.adding:
            raise TypeError("audit entries are append-only: they cannot be changed")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("audit entries are append-only: only the retention purge removes them")


def default_alert_thresholds() -> list[int]:
    return [80, 100]


def new_webhook_secret() -> str:
    return secrets.token_hex(32)


class AlertSettings(models.Model):
    """When a tenant's alerts fire and where they go (tenants.services.alerts)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="alert_settings")
    thresholds = models.JSONField(
        default=default_alert_thresholds,
        help_text="Shares of the monthly quota, and of each key's budget, in percent, at which an alert fires.",
    )
    email = models.BooleanField(default=True, help_text="E-mail the tenant's owners and admins.")
    webhook_url = models.URLField(max_length=500, blank=True, help_text="POST each alert here, signed.")
    # The key of the webhooks' HMAC-SHA256 signature; shown to the tenant's owners and admins.
    webhook_secret = models.CharField(max_length=64, default=new_webhook_secret, editable=False)
    rate_limit_hits = models.PositiveIntegerField(
        default=100, help_text="Requests refused by a rate limit within an hour that raise an alert; 0: none."
    )

    class Meta:
        verbose_name_plural = "alert settings"

    def __str__(self) -> str:
        return f"alerts of {self.tenant_id}"


class Alert(models.Model):
    """An alert that fired: once per subject, kind, threshold and period."""

    class Kind(models.TextChoices):
        QUOTA = "quota", "Monthly token quota"
        KEY_BUDGET = "key_budget", "Key's monthly token budget"
        RATE_LIMITED = "rate_limited", "Requests refused by rate limits"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="alerts")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # "tenant" or "key:<id>": part of the once-per-period rule (a NULL key would not be unique).
    subject = models.CharField(max_length=32)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    threshold = models.PositiveIntegerField(help_text="Percent of the limit; for rate_limited, the refusals.")
    period = models.CharField(max_length=16, help_text="YYYY-MM, or YYYY-MM-DDTHH for rate_limited.")
    used = models.PositiveBigIntegerField()
    limit = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "subject", "kind", "threshold", "period"], name="alert_once_per_period"
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.subject} {self.kind} {self.threshold} {self.period}"


class WebhookDelivery(models.Model):
    """One alert's webhook: its attempts and their outcome (the dashboard's delivery log)."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        DELIVERED = "delivered", "Delivered"
        FAILED = "failed", "Failed"

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    url = models.URLField(max_length=500)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    response_status = models.PositiveIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_attempt_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "webhook deliveries"

    def __str__(self) -> str:
        return f"{self.alert_id} -> {self.url} ({self.status})"


class SsoIdentity(models.Model):
    """The identity provider's account a user signs in with (OpenID Connect: issuer and subject)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_identity"
    )
    issuer = models.CharField(max_length=300)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_login_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "SSO identities"
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="sso_identity_unique")]

    def __str__(self) -> str:
        return f"{self.subject}@{self.issuer}"
