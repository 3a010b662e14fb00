"""The operator's Django admin: tenants with their limits and members inline, API keys (the secret
shown once, a revoke action, never a digest), and the usage ledger with filters and a per-day chart."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from core.errors import AuthenticationError
from tenants.models import ApiKey, Membership, Tenant, UsageDaily, UsageRecord
from tenants.services import api_key_authenticate, api_key_create, usage_rollup
from tenants.services.tenants import LIMIT_FIELDS
from tests.helpers import MODEL, usage_row

DEFAULT_RPM = settings.TENANT_DEFAULT_LIMITS["requests_per_minute"]  # the world's tenants have the defaults
pytestmark = pytest.mark.django_db

DAY1, DAY2 = date(2026, 3, 9), date(2026, 3, 10)


@pytest.fixture
def operator() -> Client:
    user = get_user_model().objects.create_superuser("operator", "op@example.com", "operator-password")
    client = Client()
    client.force_login(user)
    return client


def _inline_management(
    prefix: str, *, total: int, initial: int = 0, minimum: int = 0, maximum: int = 1000
) -> dict:
    return {
        f"{prefix}-TOTAL_FORMS": str(total),
        f"{prefix}-INITIAL_FORMS": str(initial),
        f"{prefix}-MIN_NUM_FORMS": str(minimum),
        f"{prefix}-MAX_NUM_FORMS": str(maximum),
    }


def test_tenant_add_page_has_limits_and_members_inline(operator):
    html = operator.get("/admin/tenants/tenant/add/").content.decode()

    assert len(LIMIT_FIELDS) == 9
    for field in LIMIT_FIELDS:
        assert f'name="limits-0-{field}"' in html, field
    assert 'name="memberships-TOTAL_FORMS"' in html
    assert 'name="memberships-__prefix__-role"' in html


def test_operator_creates_a_tenant_with_limits_and_an_owner_in_one_form(operator, world):
    user = get_user_model().objects.create_user("new-owner", password="pw")
    data = {
        "name": "Initech",
        "slug": "initech",
        "active": "on",
        **_inline_management("limits", total=1, minimum=1, maximum=1),
        "limits-0-requests_per_minute": "60",
        "limits-0-tokens_per_minute": "10000",
        "limits-0-max_concurrent_requests": "4",
        "limits-0-monthly_token_quota": "1000000",
        "limits-0-allowed_models": f'["{MODEL}"]',
        "limits-0-fair_share_weight": "3",
        "limits-0-service_tiers": '["default", "priority"]',
        "limits-0-max_queued_requests": "8",
        "limits-0-queue_timeout_seconds": "30",
        **_inline_management("memberships", total=1),
        **_inline_management("alert_settings", total=0, maximum=1),
        "memberships-0-user": str(user.pk),
        "memberships-0-role": "owner",
    }

    response = operator.post("/admin/tenants/tenant/add/", data)

    assert response.status_code == 302, response.content.decode()[:2000]
    tenant = Tenant.objects.get(slug="initech")
    limits = tenant.limits
    assert (
        limits.requests_per_minute,
        limits.tokens_per_minute,
        limits.max_concurrent_requests,
        limits.monthly_token_quota,
        limits.allowed_models,
        limits.fair_share_weight,
        limits.service_tiers,
        limits.max_queued_requests,
        limits.queue_timeout_seconds,
    ) == (60, 10000, 4, 1_000_000, [MODEL], 3, ["default", "priority"], 8, 30)
    assert list(Membership.objects.filter(tenant=tenant).values_list("user__username", "role")) == [
        ("new-owner", "owner")
    ]


def test_the_admin_refuses_an_unknown_service_tier(operator, world):
    data = {
        "name": "Initech",
        "slug": "initech",
        "active": "on",
        **_inline_management("limits", total=1, minimum=1, maximum=1),
        "limits-0-allowed_models": "[]",
        "limits-0-fair_share_weight": "1",
        "limits-0-service_tiers": '["default", "platinum"]',
        **_inline_management("memberships", total=0),
        **_inline_management("alert_settings", total=0, maximum=1),
    }
    response = operator.post("/admin/tenants/tenant/add/", data)
    assert response.status_code == 200 and "A list of service tiers" in response.content.decode()
    assert not Tenant.objects.filter(slug="initech").exists()


def test_limits_edited_in_the_admin_reach_cached_keys_at_once(
    operator, world, django_capture_on_commit_callbacks
):
    assert (
        api_key_authenticate(raw_key=world.raw_key_a).tenant_limits.requests_per_minute == DEFAULT_RPM
    )  # cached
    limits = world.tenant_a.limits
    data = {
        "name": world.tenant_a.name,
        "slug": world.tenant_a.slug,
        "active": "on",
        **_inline_management("limits", total=1, initial=1, minimum=1, maximum=1),
        "limits-0-id": str(limits.pk),
        "limits-0-tenant": str(world.tenant_a.pk),
        "limits-0-requests_per_minute": "7",
        "limits-0-allowed_models": f'["{MODEL}"]',
        "limits-0-fair_share_weight": "4",
        "limits-0-service_tiers": '["default", "flex", "priority"]',
        **_inline_management("memberships", total=0),
        **_inline_management("alert_settings", total=0, maximum=1),
    }

    with django_capture_on_commit_callbacks(execute=True):
        response = operator.post(f"/admin/tenants/tenant/{world.tenant_a.pk}/change/", data)

    assert response.status_code == 302, response.content.decode()[:2000]
    context = api_key_authenticate(raw_key=world.raw_key_a)
    assert context.tenant_limits.requests_per_minute == 7
    assert context.tenant_limits.fair_share_weight == 4
    assert context.tenant_limits.service_tiers == ("default", "flex", "priority")
    assert context.allowed_models == (MODEL,)


def test_key_created_in_the_admin_shows_its_secret_once_and_never_the_digest(operator, world):
    response = operator.post(
        "/admin/tenants/apikey/add/",
        {
            "tenant": str(world.tenant_a.pk),
            "name": "from the admin",
            "requests_per_minute": "30",
            "allowed_models": "null",
            "scope": "all",
        },
    )

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    html = response.content.decode()
    raw_key = re.search(r'id="new-api-key" readonly value="([^"]+)"', html).group(1)
    key = ApiKey.objects.get(name="from the admin")
    assert raw_key.startswith(key.display_prefix + "_")
    assert key.digest not in html
    assert (key.tenant_id, key.requests_per_minute, key.created_by.username) == (
        world.tenant_a.pk,
        30,
        "operator",
    )
    assert api_key_authenticate(raw_key=raw_key).api_key_id == key.pk

    secret = raw_key.split("_", 1)[1]
    for url in (
        "/admin/tenants/apikey/",
        f"/admin/tenants/apikey/{key.pk}/change/",
        f"/admin/tenants/apikey/{key.pk}/history/",
        "/admin/tenants/apikey/?q=" + key.prefix,
    ):
        page = operator.get(url)
        assert page.status_code == 200, url
        text = page.content.decode()
        assert secret not in text, url
        assert key.digest not in text, url
        assert 'name="digest"' not in text, url
        assert key.display_prefix in text, url


def test_key_change_form_cannot_move_a_key_or_touch_its_digest(operator, world):
    key = world.key_a
    digest = key.digest
    response = operator.post(
        f"/admin/tenants/apikey/{key.pk}/change/",
        {
            "name": "renamed",
            "tenant": str(world.tenant_b.pk),
            "digest": "0" * 64,
            "previous_digest": "1" * 64,
            "allowed_models": "null",
            "scope": "inference",
        },
    )

    assert response.status_code == 302
    key.refresh_from_db()
    assert (key.name, key.tenant_id, key.digest, key.previous_digest) == (
        "renamed",
        world.tenant_a.pk,
        digest,
        "",
    )
    assert key.scope == "inference"


def test_rotate_action_shows_the_new_secret_once_and_keeps_the_old_one_for_a_day(operator, world):
    response = operator.post(
        "/admin/tenants/apikey/", {"action": "rotate_selected", "_selected_action": [str(world.key_a.pk)]}
    )

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    html = response.content.decode()
    raw_key = re.search(r'id="new-api-key" readonly value="(sk-[^"]+)"', html).group(1)
    assert "was rotated (its previous secret stays valid until" in html
    key = ApiKey.objects.get(pk=world.key_a.pk)
    assert timedelta(hours=23, minutes=59) < key.previous_valid_until - timezone.now() <= timedelta(hours=24)
    assert api_key_authenticate(raw_key=raw_key).api_key_id == key.pk
    assert api_key_authenticate(raw_key=world.raw_key_a).api_key_id == key.pk


def test_rotate_action_takes_one_key_at_a_time(operator, world):
    spare, _ = api_key_create(tenant=world.tenant_a, name="spare")
    digests = dict(ApiKey.objects.values_list("pk", "digest"))

    response = operator.post(
        "/admin/tenants/apikey/",
        {"action": "rotate_selected", "_selected_action": [str(world.key_a.pk), str(spare.pk)]},
        follow=True,
    )

    assert "Rotate one key at a time" in response.content.decode()
    assert dict(ApiKey.objects.values_list("pk", "digest")) == digests


def test_revoke_action_revokes_the_selected_keys_everywhere(
    operator, world, django_capture_on_commit_callbacks
):
    api_key_authenticate(raw_key=world.raw_key_a)  # cached in this process
    spare, _ = api_key_create(tenant=world.tenant_a, name="spare")

    with django_capture_on_commit_callbacks(execute=True):
        response = operator.post(
            "/admin/tenants/apikey/",
            {"action": "revoke_selected", "_selected_action": [str(world.key_a.pk), str(world.key_b.pk)]},
            follow=True,
        )

    assert response.status_code == 200
    assert "Revoked 2 API key(s)." in response.content.decode()
    assert set(ApiKey.objects.filter(revoked_at__isnull=False).values_list("pk", flat=True)) == {
        world.key_a.pk,
        world.key_b.pk,
    }
    assert ApiKey.objects.get(pk=spare.pk).revoked_at is None
    with pytest.raises(AuthenticationError, match="revoked"):
        api_key_authenticate(raw_key=world.raw_key_a)


def test_keys_cannot_be_deleted_from_the_admin(operator, world):
    assert operator.get(f"/admin/tenants/apikey/{world.key_a.pk}/delete/").status_code == 403
    assert ApiKey.objects.filter(pk=world.key_a.pk).exists()


def _record(
    key: ApiKey, request_id: str, *, day: date, hour: int, model: str = MODEL, prompt: int, completion: int
):
    usage_row(
        key,
        model=model,
        prompt=prompt,
        completion=completion,
        request_id=request_id,
        created_at=datetime(day.year, day.month, day.day, hour, tzinfo=UTC),
    )


def _chart_bars(html: str) -> list[str]:
    chart = html.split('id="usage-chart"', 1)[1].split("</figure>", 1)[0]
    return re.findall(r"<title>([^<]+)</title>", chart)


def test_usage_admin_filters_by_tenant_model_and_day_and_charts_tokens_per_day(operator, world):
    _record(world.key_a, "a1", day=DAY1, hour=1, prompt=10, completion=5)
    _record(world.key_a, "a2", day=DAY1, hour=9, model="other-model", prompt=20, completion=10)
    _record(world.key_a, "a3", day=DAY2, hour=3, prompt=1, completion=1)
    _record(world.key_b, "b1", day=DAY1, hour=2, prompt=1000, completion=1000)

    everything = operator.get("/admin/tenants/usagerecord/").content.decode()
    for title in ("tenant", "model", "status", "created at"):
        assert f'data-filter-title="{title}"' in everything, title
    assert _chart_bars(everything) == [
        "2026-03-09: 3 requests, 2045 tokens",
        "2026-03-10: 1 requests, 2 tokens",
    ]

    tenant_a = operator.get(
        f"/admin/tenants/usagerecord/?tenant__id__exact={world.tenant_a.pk}"
    ).content.decode()
    assert _chart_bars(tenant_a) == ["2026-03-09: 2 requests, 45 tokens", "2026-03-10: 1 requests, 2 tokens"]
    assert re.findall(r'<th class="field-request_id"><a [^>]*>([^<]+)</a>', tenant_a) == ["a3", "a2", "a1"]

    by_model = operator.get(
        f"/admin/tenants/usagerecord/?tenant__id__exact={world.tenant_a.pk}&model={MODEL}"
    ).content.decode()
    assert _chart_bars(by_model) == ["2026-03-09: 1 requests, 15 tokens", "2026-03-10: 1 requests, 2 tokens"]

    one_day = operator.get(
        "/admin/tenants/usagerecord/?created_at__year=2026&created_at__month=3&created_at__day=10"
    ).content.decode()
    assert _chart_bars(one_day) == ["2026-03-10: 1 requests, 2 tokens"]


def test_usage_admin_is_read_only(operator, world):
    _record(world.key_a, "a1", day=DAY1, hour=1, prompt=10, completion=5)
    record = UsageRecord.objects.get()

    assert operator.get("/admin/tenants/usagerecord/add/").status_code == 403
    assert operator.post(f"/admin/tenants/usagerecord/{record.pk}/delete/").status_code == 403
    operator.post(f"/admin/tenants/usagerecord/{record.pk}/change/", {"prompt_tokens": "999"})
    record.refresh_from_db()
    assert record.prompt_tokens == 10


def test_daily_rollups_are_listed_with_filters(operator, world):
    _record(world.key_a, "a1", day=DAY1, hour=1, prompt=10, completion=5)
    usage_rollup(day=DAY1)

    html = operator.get(f"/admin/tenants/usagedaily/?tenant__id__exact={world.tenant_a.pk}").content.decode()

    assert UsageDaily.objects.count() == 1
    assert 'data-filter-title="day"' in html
    assert '<td class="field-prompt_tokens">10</td>' in html
