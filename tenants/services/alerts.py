"""Alerts: a tenant's monthly quota, or a key's budget, past a share of it (by default 80% and
100%), and rate limits hit repeatedly (AlertSettings.rate_limit_hits refusals within an hour).

`alerts_check` (a Celery beat task, every minute) compares what the ledger holds for the month with
each tenant's thresholds. Each alert fires once per subject, kind, threshold and period (a unique
row, tenants.models.Alert): e-mail to the tenant's owners and admins, and a webhook.

Webhooks are POSTed as JSON with `X-Pagoda-Signature: t=<unix time>,v1=<hex HMAC-SHA256 over
"<t>.<body>" with the tenant's webhook secret>`, retried with backoff (WEBHOOK_MAX_ATTEMPTS);
every attempt is in the delivery log. A URL that resolves to a private, loopback or link-local
address is refused unless WEBHOOK_ALLOW_PRIVATE, so a tenant cannot aim the platform at its own
network; redirects are not followed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from celery import signature
from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, models, transaction
from django.utils import timezone

from core.errors import InvalidRequestError
from tenants.models import (
    Alert,
    AlertSettings,
    ApiKey,
    Membership,
    Tenant,
    WebhookDelivery,
    new_webhook_secret,
)
from tenants.ratelimit import limiter
from tenants.selectors import quota_used_this_month
from tenants.services.audit import audit_record, audit_snapshot

SIGNATURE_HEADER = "X-Pagoda-Signature"
WEBHOOK_TASK = "tenants.tasks.webhook_deliver"


def alert_settings_get(*, tenant: Tenant) -> AlertSettings:
    settings_row, _ = AlertSettings.objects.get_or_create(tenant=tenant)
    return settings_row


def _check_thresholds(value: object) -> list[int]:
    if not isinstance(value, list) or not value or len(value) > 10:
        raise InvalidRequestError("Give one to ten thresholds.", param="thresholds")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 100 for v in value):
        raise InvalidRequestError("Thresholds are whole percents from 1 to 100.", param="thresholds")
    return sorted(set(value))


def _check_webhook_url(url: str) -> str:
    if url and urlsplit(url).scheme not in ("http", "https"):
        raise InvalidRequestError("The webhook URL must be http or https.", param="webhook_url")
    return url


def alert_settings_update(
    *,
    tenant: Tenant,
    thresholds: list[int] | None = None,
    email: bool | None = None,
    webhook_url: str | None = None,
    rate_limit_hits: int | None = None,
    new_secret: bool = False,
) -> AlertSettings:
    with transaction.atomic():
        row = alert_settings_get(tenant=tenant)
        row = AlertSettings.objects.select_for_update().get(pk=row.pk)
        before = audit_snapshot(row)
        if thresholds is not None:
            row.thresholds = _check_thresholds(thresholds)
        if email is not None:
            row.email = email
        if webhook_url is not None:
            row.webhook_url = _check_webhook_url(webhook_url.strip())
        if rate_limit_hits is not None:
            row.rate_limit_hits = max(0, int(rate_limit_hits))
        if new_secret:
            row.webhook_secret = new_webhook_secret()
        row.save()
        after = audit_snapshot(row)
        if new_secret:  # that it changed, never the secret itself
            before["webhook_secret"], after["webhook_secret"] = "(previous)", "(new)"
        audit_record(action="update", obj=row, tenant_id=tenant.pk, before=before, after=after)
    return row


# --- firing --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Crossing:
    tenant: Tenant
    subject: str
    kind: str
    threshold: int
    period: str
    used: int
    limit: int
    api_key: ApiKey | None = None


def _fire(crossing: _Crossing) -> Alert | None:
    """The alert, once: None when it fired before in this period."""
    try:
        with transaction.atomic():
            alert = Alert.objects.create(
                tenant=crossing.tenant,
                api_key=crossing.api_key,
                subject=crossing.subject,
                kind=crossing.kind,
                threshold=crossing.threshold,
                period=crossing.period,
                used=crossing.used,
                limit=crossing.limit,
            )
    except IntegrityError:
        return None
    transaction.on_commit(lambda: _deliver(alert.pk))
    return alert


def _crossings(tenant: Tenant, row: AlertSettings, now: datetime) -> list[_Crossing]:
    period = now.strftime("%Y-%m")
    found = []
    limits = getattr(tenant, "limits", None)
    quota = getattr(limits, "monthly_token_quota", None)
    thresholds = [t for t in (row.thresholds or []) if isinstance(t, int)]
    if quota:
        used = quota_used_this_month(tenant_id=tenant.pk, now=now)
        found += [
            _Crossing(tenant, "tenant", Alert.Kind.QUOTA, t, period, used, quota)
            for t in thresholds
            if used * 100 >= t * quota
        ]
    for key in ApiKey.objects.filter(tenant=tenant, revoked_at__isnull=True, monthly_token_budget__gt=0):
        used = quota_used_this_month(tenant_id=tenant.pk, api_key_id=key.pk, now=now)
        budget = int(key.monthly_token_budget or 0)
        found += [
            _Crossing(tenant, f"key:{key.pk}", Alert.Kind.KEY_BUDGET, t, period, used, budget, key)
            for t in thresholds
            if used * 100 >= t * budget
        ]
    if row.rate_limit_hits:
        for hour in (now - timedelta(hours=1), now):
            label = hour.strftime("%Y-%m-%dT%H")
            hits = limiter.rate_limited_count(tenant_id=tenant.pk, hour=label)
            if hits >= row.rate_limit_hits:
                found.append(
                    _Crossing(
                        tenant,
                        "tenant",
                        Alert.Kind.RATE_LIMITED,
                        row.rate_limit_hits,
                        label,
                        hits,
                        row.rate_limit_hits,
                    )
                )
    return found


# A delivery pending this long with no attempt queued (the broker was down when its alert fired,
# or a worker died with the task) is queued again by the next check.
LOST_DELIVERY_AFTER = timedelta(minutes=15)


def alerts_check(*, now: datetime | None = None) -> int:
    """Fire what crossed a threshold and has not fired in its period; returns how many fired. Also
    queues again the webhook deliveries that were lost on the way."""
    now = now or timezone.now()
    horizon = now - LOST_DELIVERY_AFTER
    lost = WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING).filter(
        models.Q(last_attempt_at__lt=horizon) | models.Q(last_attempt_at__isnull=True, created_at__lt=horizon)
    )
    for delivery_id in lost.values_list("pk", flat=True):
        signature(WEBHOOK_TASK, args=(delivery_id,)).delay()
    fired = 0
    for tenant in Tenant.objects.filter(active=True).select_related("limits").order_by("pk"):
        row = alert_settings_get(tenant=tenant)
        for crossing in _crossings(tenant, row, now):
            if _fire(crossing) is not None:
                fired += 1
    return fired


# --- delivery ------------------------------------------------------------------------------------


def alert_payload(alert: Alert) -> dict:
    return {
        "id": f"alert_{alert.pk}",
        "type": f"{alert.kind}.threshold",
        "created": int(alert.created_at.timestamp()),
        "tenant": alert.tenant.slug,
        "api_key": alert.api_key.display_prefix if alert.api_key else None,
        "kind": alert.kind,
        "threshold": alert.threshold,
        "period": alert.period,
        "used": alert.used,
        "limit": alert.limit,
    }


def alert_message(alert: Alert) -> tuple[str, str]:
    tenant = alert.tenant.name
    if alert.kind == Alert.Kind.RATE_LIMITED:
        subject = f"{tenant}: {alert.used} requests refused by rate limits in an hour"
        body = f"Rate limits refused {alert.used} requests of {tenant} in the hour {alert.period} UTC."
    else:
        what = (
            "the monthly token quota"
            if alert.kind == Alert.Kind.QUOTA
            else (f"the monthly token budget of the key {alert.api_key.name if alert.api_key else '?'}")
        )
        subject = f"{tenant}: {alert.threshold}% of {what} used"
        body = f"{tenant} has used {alert.used:,} of {alert.limit:,} tokens of {what} in {alert.period}."
    return subject, body


def _deliver(alert_id: int) -> None:
    alert = Alert.objects.select_related("tenant", "api_key").get(pk=alert_id)
    row = alert_settings_get(tenant=alert.tenant)
    if row.email:
        recipients = sorted(
            {
                m.user.email
                for m in Membership.objects.filter(
                    tenant=alert.tenant, role__in=[Membership.Role.OWNER, Membership.Role.ADMIN]
                ).select_related("user")
                if m.user.email
            }
        )
        if recipients:
            subject, body = alert_message(alert)
            send_mail(subject, body, None, recipients, fail_silently=True)
    if row.webhook_url:
        delivery = WebhookDelivery.objects.create(alert=alert, url=row.webhook_url)
        # By name: the task module imports this one. A broker outage leaves the delivery pending.
        try:
            signature(WEBHOOK_TASK, args=(delivery.pk,)).delay()
        except Exception as exc:  # noqa: BLE001 - the alert stands; the log shows why nothing went
            WebhookDelivery.objects.filter(pk=delivery.pk).update(error=f"not queued: {exc}"[:500])


def webhook_signature(*, secret: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _refused_address(url: str) -> str | None:
    host = urlsplit(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as exc:
        return f"cannot resolve {host}: {exc}"
    if settings.WEBHOOK_ALLOW_PRIVATE:
        return None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast:
            return f"refused: {host} resolves to a private address ({ip})"
    return None


class WebhookFailed(Exception):
    """An attempt failed in a way another attempt may fix (a 5xx, a timeout, a refused connection)."""

    def __init__(self, message: str, *, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


def webhook_backoff_s(*, attempts: int) -> float:
    """Seconds before the next attempt: 2, 4, 8 ... up to ten minutes, with a quarter of jitter."""
    base = min(600.0, 2.0**attempts)
    return base * (0.75 + secrets.randbelow(1000) / 2000)


def webhook_attempt(*, delivery_id: int) -> bool:
    """One attempt at a delivery; True when delivered (or failed for good), WebhookFailed to retry."""
    delivery = WebhookDelivery.objects.select_related("alert__tenant", "alert__api_key").get(pk=delivery_id)
    if delivery.status != WebhookDelivery.Status.PENDING:
        return True
    row = alert_settings_get(tenant=delivery.alert.tenant)
    body = json.dumps(alert_payload(delivery.alert), sort_keys=True).encode()
    timestamp = int(time.time())
    delivery.attempts += 1
    delivery.last_attempt_at = timezone.now()
    refused = _refused_address(delivery.url)
    if refused:
        delivery.status, delivery.error = WebhookDelivery.Status.FAILED, refused[:500]
        delivery.save()
        return True
    request = urllib.request.Request(
        delivery.url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "Pagoda-Webhook/1",
            SIGNATURE_HEADER: webhook_signature(secret=row.webhook_secret, timestamp=timestamp, body=body),
        },
    )
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(request, timeout=settings.WEBHOOK_TIMEOUT_S) as response:
            delivery.response_status = response.status
    except urllib.error.HTTPError as exc:
        delivery.response_status, delivery.error = exc.code, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        delivery.response_status, delivery.error = None, str(getattr(exc, "reason", exc))[:500]
    if delivery.response_status is not None and 200 <= delivery.response_status < 300:
        delivery.status, delivery.error = WebhookDelivery.Status.DELIVERED, ""
        delivery.save()
        return True
    retryable = (
        delivery.response_status is None or delivery.response_status >= 500 or delivery.response_status == 429
    )
    if not retryable or delivery.attempts >= settings.WEBHOOK_MAX_ATTEMPTS:
        delivery.status = WebhookDelivery.Status.FAILED
        delivery.save()
        return True
    delivery.save()
    raise WebhookFailed(delivery.error or f"HTTP {delivery.response_status}", attempts=delivery.attempts)
