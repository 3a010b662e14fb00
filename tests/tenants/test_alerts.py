"""Alerts: quota and key budget thresholds and rate limits hit repeatedly fire once per period, by
e-mail (Django's test outbox) to the tenant's owners and admins and by signed webhooks, received by
a real HTTP server started here, retried after a 500."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.urls import reverse
from django.utils import timezone

from core.errors import RateLimitError
from tenants.models import Alert, AlertSettings, AuditEntry, WebhookDelivery
from tenants.services import api_key_authenticate, api_key_create, request_admit, tenant_limits_update
from tenants.services.alerts import SIGNATURE_HEADER, alert_settings_update, alerts_check
from tests.helpers import MODEL, logged_in, usage_row

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _emails(world):
    for user, address in ((world.owner_a, "owner@a.example"), (world.admin_a, "admin@a.example")):
        user.email = address
        user.save(update_fields=["email"])
    world.member_a.email = "member@a.example"  # a member is not alerted
    world.member_a.save(update_fields=["email"])


class Receiver:
    """A webhook receiver: answers each POST with the next status of `statuses` (then 200)."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.received: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((dict(self.headers), body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/pagoda"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver([500])
    yield server
    server.close()


def spend(world, tokens: int, *, key=None, request_id: str) -> None:
    usage_row(key or world.key_a, model=MODEL, prompt=tokens, completion=0, request_id=request_id)


def test_quota_thresholds_fire_once_each_by_email_to_owners_and_admins(world, mailoutbox, celery_eager):
    tenant_limits_update(tenant=world.tenant_a, monthly_token_quota=1000)
    spend(world, 850, request_id="r1")

    assert alerts_check() == 1
    assert alerts_check() == 0  # once per period

    [alert] = Alert.objects.all()
    assert (alert.kind, alert.threshold, alert.used, alert.limit, alert.subject) == (
        "quota",
        80,
        850,
        1000,
        "tenant",
    )
    [mail] = mailoutbox
    assert sorted(mail.to) == ["admin@a.example", "owner@a.example"]
    assert mail.subject == f"{world.tenant_a.name}: 80% of the monthly token quota used"
    spend(world, 150, request_id="r2")
    assert alerts_check() == 1
    assert [a.threshold for a in Alert.objects.order_by("threshold")] == [80, 100]
    assert len(mailoutbox) == 2


def test_a_keys_budget_alerts_name_the_key(world, mailoutbox, celery_eager):
    key, _ = api_key_create(tenant=world.tenant_a, name="ci runner", monthly_token_budget=100)
    spend(world, 90, key=key, request_id="k1")

    assert alerts_check() == 1

    [alert] = Alert.objects.all()
    assert (alert.kind, alert.api_key_id, alert.subject, alert.threshold) == (
        "key_budget",
        key.pk,
        f"key:{key.pk}",
        80,
    )
    assert (
        mailoutbox[0].subject
        == f"{world.tenant_a.name}: 80% of the monthly token budget of the key ci runner used"
    )


def test_rate_limits_hit_repeatedly_fire_once_an_hour(world, mailoutbox, celery_eager):
    alert_settings_update(tenant=world.tenant_a, rate_limit_hits=3)
    tenant_limits_update(tenant=world.tenant_a, requests_per_minute=1)
    auth = api_key_authenticate(raw_key=world.raw_key_a)
    request_admit(auth=auth)
    for _ in range(3):
        with pytest.raises(RateLimitError):
            request_admit(auth=auth)

    assert alerts_check() == 1
    assert alerts_check() == 0

    [alert] = Alert.objects.all()
    assert (alert.kind, alert.used, alert.threshold) == ("rate_limited", 3, 3)


def test_a_webhook_is_signed_retried_after_a_500_and_logged(world, settings, receiver, celery_eager):
    settings.WEBHOOK_ALLOW_PRIVATE = True  # the receiver listens on 127.0.0.1
    row = alert_settings_update(tenant=world.tenant_a, webhook_url=receiver.url, email=False)
    tenant_limits_update(tenant=world.tenant_a, monthly_token_quota=1000)
    spend(world, 800, request_id="r1")

    assert alerts_check() == 1

    assert len(receiver.received) == 2  # a 500, then delivered
    for headers, body in receiver.received:
        timestamp, signature = (part.split("=", 1)[1] for part in headers[SIGNATURE_HEADER].split(","))
        expected = hmac.new(row.webhook_secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
        assert hmac.compare_digest(signature, expected.hexdigest())
    payload = json.loads(receiver.received[-1][1])
    assert {k: payload[k] for k in ("type", "tenant", "threshold", "used", "limit", "api_key")} == {
        "type": "quota.threshold",
        "tenant": world.tenant_a.slug,
        "threshold": 80,
        "used": 800,
        "limit": 1000,
        "api_key": None,
    }
    [delivery] = WebhookDelivery.objects.all()
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("delivered", 2, 200)
    page = (
        logged_in(world.owner_a).get(reverse("dashboard:alerts", args=[world.tenant_a.slug])).content.decode()
    )
    assert "Delivered after 2 attempts (HTTP 200)" in page


def test_a_webhook_to_a_private_address_is_refused_without_a_request(world, settings, receiver, celery_eager):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    alert_settings_update(tenant=world.tenant_a, webhook_url=receiver.url, email=False)
    tenant_limits_update(tenant=world.tenant_a, monthly_token_quota=1000)
    spend(world, 800, request_id="r1")

    assert alerts_check() == 1

    [delivery] = WebhookDelivery.objects.all()
    assert delivery.status == "failed" and delivery.error.startswith(
        "refused: 127.0.0.1 resolves to a private address"
    )
    assert receiver.received == []


def test_owners_set_alerts_members_may_not_outsiders_get_404_and_the_secret_stays_out_of_the_audit(world):
    url = reverse("dashboard:alerts", args=[world.tenant_a.slug])
    owner = logged_in(world.owner_a)
    old_secret = AlertSettings.objects.get_or_create(tenant=world.tenant_a)[0].webhook_secret

    saved = owner.post(
        url,
        {
            "thresholds": "50, 90",
            "email": "on",
            "webhook_url": "https://hooks.example/p",
            "rate_limit_hits": "10",
            "new_secret": "1",
        },
    )
    refused = owner.post(url, {"thresholds": "150", "webhook_url": "", "rate_limit_hits": "0"})

    assert saved.status_code == 302 and refused.status_code == 400
    row = AlertSettings.objects.get(tenant=world.tenant_a)
    assert (row.thresholds, row.email, row.webhook_url, row.rate_limit_hits) == (
        [50, 90],
        True,
        "https://hooks.example/p",
        10,
    )
    assert row.webhook_secret != old_secret
    entry = AuditEntry.objects.filter(object_type="alertsettings").latest("id")
    assert entry.changes["webhook_secret"] == ["(previous)", "(new)"]
    assert old_secret not in json.dumps(entry.changes) and row.webhook_secret not in json.dumps(entry.changes)
    assert logged_in(world.member_a).get(url).status_code == 403
    assert logged_in(world.outsider_b).get(url).status_code == 404


def test_a_delivery_lost_on_the_way_is_queued_again_by_the_next_check(
    world, settings, receiver, celery_eager
):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    receiver.statuses = []
    alert = Alert.objects.create(
        tenant=world.tenant_a,
        subject="tenant",
        kind="quota",
        threshold=80,
        period="2026-11",
        used=800,
        limit=1000,
    )
    lost = WebhookDelivery.objects.create(alert=alert, url=receiver.url)
    WebhookDelivery.objects.filter(pk=lost.pk).update(created_at=timezone.now() - timedelta(minutes=20))
    fresh = WebhookDelivery.objects.create(alert=alert, url=receiver.url)  # its task may still come

    alerts_check()

    assert WebhookDelivery.objects.get(pk=lost.pk).status == "delivered"
    assert WebhookDelivery.objects.get(pk=fresh.pk).status == "pending"
    assert len(receiver.received) == 1
