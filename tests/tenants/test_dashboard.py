"""The tenant dashboard through Django's test client, against the real database and Redis.

World: the fixture world (tests/conftest.py) named as people would see it: tenant A is Acme
Research (an owner, an admin and a member), tenant B is Globex Labs, owned by the outsider.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLResolver, get_resolver, reverse
from django.utils import timezone

from core.errors import AuthenticationError
from tenants.models import ApiKey, Membership
from tenants.services import (
    api_key_authenticate,
    api_key_create,
    membership_create,
    tenant_create,
    tenant_limits_update,
)
from tests.helpers import PASSWORD, acme, logged_in, usage_row

pytestmark = pytest.mark.django_db


@pytest.fixture
def world_options() -> dict:
    return {
        "tenant_a": acme(),
        "tenant_b": {"name": "Globex Labs", "slug": "globex", "allowed_models": ["globex-secret-model"]},
        "usernames": ("olivia", "adam", "mia", "oscar"),
        "key_names": ("acme-prod", "globex-prod"),
    }


def _record(*, key: ApiKey, model: str, prompt: int, completion: int, days_ago: int = 0, status="success"):
    return usage_row(
        key,
        model=model,
        prompt=prompt,
        completion=completion,
        status=status,
        request_id=f"req-{key.pk}-{model}-{prompt}-{completion}-{days_ago}",
        created_at=timezone.now() - timedelta(days=days_ago) if days_ago else None,
    )


def test_anonymous_visitor_is_sent_to_the_login_page(world):
    response = Client().get(reverse("dashboard:overview", args=["acme"]))

    assert response.status_code == 302
    assert response["Location"].startswith("/dashboard/login/?next=/dashboard/t/acme/")


def test_user_logs_in_with_the_form_and_lands_on_their_tenant(world):
    client = Client()
    response = client.post("/dashboard/login/", {"username": "mia", "password": PASSWORD}, follow=True)

    assert response.redirect_chain[-1] == ("/dashboard/t/acme/", 302)
    assert response.status_code == 200
    assert "Acme Research" in response.content.decode()


def test_member_sees_only_their_own_tenant(world):
    response = logged_in(world.member_a).get(reverse("dashboard:overview", args=["acme"]))
    html = response.content.decode()

    assert response.status_code == 200
    assert "Acme Research" in html
    assert "Globex" not in html
    assert 'id="tenant-switch"' not in html  # a single membership: no switcher


def test_user_with_two_memberships_gets_a_switcher_listing_exactly_those_tenants(world):
    membership_create(tenant=world.tenant_b, user=world.member_a, role=Membership.Role.MEMBER)
    tenant_create(name="Initech", slug="initech")

    html = logged_in(world.member_a).get(reverse("dashboard:overview", args=["acme"])).content.decode()

    switcher = html.split('id="tenant-switch"', 1)[1].split("</select>", 1)[0]
    assert re.findall(r'value="([^"]+)"', switcher) == ["acme", "globex"]
    switch = logged_in(world.member_a).get(reverse("dashboard:switch") + "?tenant=globex")
    assert switch["Location"] == "/dashboard/t/globex/"


def _tenant_a_urls(world) -> list[tuple[str, str]]:
    key = world.key_a.pk
    return [
        ("get", reverse("dashboard:overview", args=["acme"])),
        ("get", reverse("dashboard:keys", args=["acme"])),
        ("post", reverse("dashboard:key_create", args=["acme"])),
        ("get", reverse("dashboard:key_detail", args=["acme", key])),
        ("get", reverse("dashboard:key_revoke", args=["acme", key])),
        ("post", reverse("dashboard:key_revoke", args=["acme", key])),
        ("get", reverse("dashboard:usage", args=["acme"])),
        ("get", reverse("dashboard:playground", args=["acme"])),
    ]


def test_outsider_gets_404_on_every_dashboard_url_of_tenant_a(world):
    client = logged_in(world.outsider_b)

    for method, url in _tenant_a_urls(world):
        data = {"name": "stolen"} if method == "post" else None
        response = getattr(client, method)(url, data)
        assert response.status_code == 404, (method, url)
        assert "Acme" not in response.content.decode()

    assert ApiKey.objects.filter(tenant=world.tenant_a).count() == 1
    world.key_a.refresh_from_db()
    assert world.key_a.revoked_at is None


def _tenant_routes() -> list[str]:
    """Every routed URL pattern that names a tenant (`<slug:slug>`), whoever added it."""
    routes: list[str] = []

    def walk(patterns, prefix: str) -> None:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, route)
            elif "<slug:slug>" in route:
                routes.append(route)

    walk(get_resolver().url_patterns, "/")
    return routes


def _fill(route: str, *, slug: str, key_id: int) -> str:
    values = {
        "slug": slug,
        "int": str(key_id),
        "str": "some-name",
        "path": "some/name",
        "uuid": str(uuid.uuid4()),
    }
    return re.sub(
        r"<(?:(\w+):)?(\w+)>", lambda m: values["slug" if m[2] == "slug" else (m[1] or "str")], route
    )


def test_outsider_cannot_tell_tenant_a_exists_from_any_tenant_url(world):
    routes = _tenant_routes()
    assert "/dashboard/t/<slug:slug>/keys/<int:key_id>/revoke/" in routes
    client = logged_in(world.outsider_b)

    for route in routes:
        statuses = {}
        for method in ("get", "post"):
            real = getattr(client, method)(_fill(route, slug="acme", key_id=world.key_a.pk))
            missing = getattr(client, method)(_fill(route, slug="no-such-tenant", key_id=world.key_a.pk))
            assert real.status_code == missing.status_code, (method, route)
            assert "Acme" not in real.content.decode()
            statuses[method] = real.status_code
        # 405 only where the view takes the other method whoever asks; a tenant route is 404.
        assert set(statuses.values()) <= {404, 405} and 404 in statuses.values(), (route, statuses)

    assert list(ApiKey.objects.filter(tenant=world.tenant_a).values_list("name", "revoked_at")) == [
        ("acme-prod", None)
    ]


def test_tenant_b_key_is_404_through_tenant_a_urls_even_for_a_member_of_both(world):
    membership_create(tenant=world.tenant_b, user=world.owner_a, role=Membership.Role.MEMBER)
    client = logged_in(world.owner_a)
    key_b = world.key_b.pk

    assert client.get(reverse("dashboard:key_detail", args=["acme", key_b])).status_code == 404
    assert client.post(reverse("dashboard:key_revoke", args=["acme", key_b])).status_code == 404
    world.key_b.refresh_from_db()
    assert world.key_b.revoked_at is None


def test_member_role_sees_keys_read_only_and_cannot_create_or_revoke(world):
    client = logged_in(world.member_a)

    page = client.get(reverse("dashboard:keys", args=["acme"])).content.decode()
    assert "acme-prod" in page
    assert 'id="read-only-note"' in page
    assert 'id="create-key"' not in page
    assert "revoke-link" not in page

    created = client.post(reverse("dashboard:key_create", args=["acme"]), {"name": "mine"})
    revoke = client.post(reverse("dashboard:key_revoke", args=["acme", world.key_a.pk]))

    assert created.status_code == 403
    assert revoke.status_code == 403
    assert list(ApiKey.objects.filter(tenant=world.tenant_a).values_list("name", flat=True)) == ["acme-prod"]
    world.key_a.refresh_from_db()
    assert world.key_a.revoked_at is None


def test_owner_creates_a_key_and_its_secret_is_shown_exactly_once(world):
    client = logged_in(world.owner_a)

    response = client.post(
        reverse("dashboard:key_create", args=["acme"]), {"name": "ci runner", "expires_in_days": "30"}
    )

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    secret = re.search(
        r'id="new-key-secret"[^>]*value="([^"]+)"|value="([^"]+)"[^>]*id="new-key-secret"',
        response.content.decode(),
    )
    raw_key = next(g for g in secret.groups() if g)
    key = ApiKey.objects.get(tenant=world.tenant_a, name="ci runner")
    assert raw_key.startswith(key.display_prefix + "_")
    assert key.created_by == world.owner_a
    assert timedelta(days=29, hours=23) < key.expires_at - timezone.now() <= timedelta(days=30)
    assert raw_key not in (key.digest, key.prefix)
    assert api_key_authenticate(raw_key=raw_key).api_key_id == key.pk

    for url in (
        reverse("dashboard:keys", args=["acme"]),
        reverse("dashboard:key_detail", args=["acme", key.pk]),
        reverse("dashboard:overview", args=["acme"]),
    ):
        html = client.get(url).content.decode()
        assert raw_key not in html
        assert raw_key.split("_", 1)[1] not in html
    listing = client.get(reverse("dashboard:keys", args=["acme"])).content.decode()
    assert f"{key.display_prefix}…" in listing


def test_key_create_with_a_blank_name_shows_the_error_and_creates_nothing(world):
    response = logged_in(world.admin_a).post(reverse("dashboard:key_create", args=["acme"]), {"name": "  "})

    assert response.status_code == 400
    assert "This field is required." in response.content.decode()
    assert ApiKey.objects.filter(tenant=world.tenant_a).count() == 1


def test_admin_revokes_a_key_after_a_confirmation_page(world):
    client = logged_in(world.admin_a)
    _, raw_key = api_key_create(tenant=world.tenant_a, name="to revoke", created_by=world.owner_a)
    key = ApiKey.objects.get(name="to revoke")
    url = reverse("dashboard:key_revoke", args=["acme", key.pk])

    confirm = client.get(url)
    key.refresh_from_db()
    assert confirm.status_code == 200
    assert 'id="confirm-revoke"' in confirm.content.decode()
    assert key.revoked_at is None

    response = client.post(url, follow=True)

    key.refresh_from_db()
    assert key.revoked_at is not None
    assert response.redirect_chain == [(reverse("dashboard:keys", args=["acme"]), 302)]
    row = response.content.decode().split(f'data-key-id="{key.pk}"', 1)[1].split("</tr>", 1)[0]
    assert "Revoked" in row
    with pytest.raises(AuthenticationError):
        api_key_authenticate(raw_key=raw_key)


def test_revoke_without_a_csrf_token_is_refused(world):
    client = logged_in(world.owner_a, enforce_csrf=True)

    response = client.post(reverse("dashboard:key_revoke", args=["acme", world.key_a.pk]))

    assert response.status_code == 403
    world.key_a.refresh_from_db()
    assert world.key_a.revoked_at is None


def test_overview_shows_limits_and_the_monthly_quota_remaining(world):
    _record(key=world.key_a, model="tiny-llama", prompt=200_000, completion=50_000)
    _record(key=world.key_b, model="globex-secret-model", prompt=9_000, completion=9_000)

    html = logged_in(world.member_a).get(reverse("dashboard:overview", args=["acme"])).content.decode()

    assert re.search(r'id="limit-rpm">.*?600<', html, re.S)
    assert re.search(r'id="limit-tpm">.*?90,000<', html, re.S)
    assert re.search(r'id="limit-concurrency">.*?8<', html, re.S)
    assert '<strong id="quota-used">250,000</strong>' in html
    assert '<strong id="quota-remaining">750,000</strong>' in html
    assert 'style="width: 25%"' in html
    assert "tiny-qwen" in html and "globex-secret-model" not in html


def test_usage_page_charts_and_tables_per_day_and_per_model(world):
    key = world.key_a
    _record(key=key, model="tiny-llama", prompt=100, completion=20)
    _record(key=key, model="tiny-qwen", prompt=300, completion=40)
    _record(key=key, model="tiny-llama", prompt=10, completion=0, days_ago=2, status="error")
    _record(key=key, model="tiny-llama", prompt=5_000, completion=5_000, days_ago=40)  # outside 30 days
    _record(key=world.key_b, model="globex-secret-model", prompt=777, completion=777)

    response = logged_in(world.member_a).get(reverse("dashboard:usage", args=["acme"]))
    html = response.content.decode()

    assert response.status_code == 200
    daily = json.loads(
        re.search(r'id="usage-daily-data" type="application/json">(.*?)</script>', html).group(1)
    )
    models = json.loads(
        re.search(r'id="usage-model-data" type="application/json">(.*?)</script>', html).group(1)
    )
    today = timezone.now().date()
    assert len(daily) == 30
    assert daily[-1] == {"day": today.isoformat(), "requests": 2, "prompt": 400, "completion": 60}
    assert daily[-3] == {
        "day": (today - timedelta(days=2)).isoformat(),
        "requests": 1,
        "prompt": 10,
        "completion": 0,
    }
    assert sum(d["requests"] for d in daily) == 3
    assert models == [
        {"model": "tiny-qwen", "requests": 1, "prompt": 300, "completion": 40},
        {"model": "tiny-llama", "requests": 2, "prompt": 110, "completion": 20},
    ]
    assert '<div class="stat-value" id="total-requests">3</div>' in html
    assert "globex" not in html

    ninety = logged_in(world.member_a).get(reverse("dashboard:usage", args=["acme"]) + "?days=90")
    assert '<div class="stat-value" id="total-requests">4</div>' in ninety.content.decode()


def test_playground_offers_the_tenant_models_and_the_websocket_path(world):
    html = logged_in(world.member_a).get(reverse("dashboard:playground", args=["acme"])).content.decode()

    options = re.findall(
        r'<option value="([^"]+)"', html.split('id="pg-model"', 1)[1].split("</select>", 1)[0]
    )
    assert options == ["tiny-llama", "tiny-qwen"]
    assert 'data-ws-path="/ws/v1/chat"' in html


def test_user_without_membership_sees_the_no_tenant_page(world):
    response = logged_in(get_user_model().objects.create_user(username="nobody", password=PASSWORD)).get(
        reverse("dashboard:home")
    )

    assert response.status_code == 403
    assert "No tenant yet" in response.content.decode()


def test_logout_is_a_post_and_ends_the_session(world):
    client = logged_in(world.member_a)

    response = client.post(reverse("dashboard:logout"))

    assert response["Location"] == "/dashboard/login/"
    assert client.get(reverse("dashboard:overview", args=["acme"])).status_code == 302


@pytest.mark.parametrize("value", ["not a slug", "../admin", "acme/keys", "é"])
def test_switching_to_something_that_is_not_a_tenant_slug_is_404_not_a_crash(world, value):
    response = logged_in(world.member_a).get(reverse("dashboard:switch"), {"tenant": value})

    assert response.status_code == 404


def test_owner_creates_a_scoped_key_limited_to_inference_some_models_and_its_own_rates(world):
    tenant_limits_update(tenant=world.tenant_a, allowed_models=["acme-chat", "acme-embed"])
    client = logged_in(world.owner_a)
    form = client.get(reverse("dashboard:keys", args=["acme"])).content.decode()
    assert 'value="acme-chat"' in form and 'value="acme-embed"' in form

    response = client.post(
        reverse("dashboard:key_create", args=["acme"]),
        {
            "name": "chat only",
            "scope": "inference",
            "models": ["acme-chat"],
            "requests_per_minute": "30",
            "tokens_per_minute": "5000",
            "monthly_token_budget": "100000",
        },
    )

    assert response.status_code == 200
    key = ApiKey.objects.get(tenant=world.tenant_a, name="chat only")
    assert (key.scope, key.allowed_models, key.requests_per_minute, key.tokens_per_minute) == (
        "inference",
        ["acme-chat"],
        30,
        5000,
    )
    assert key.monthly_token_budget == 100_000
    detail = client.get(reverse("dashboard:key_detail", args=["acme", key.pk])).content.decode()
    assert "Inference only" in detail and "acme-chat" in detail
    assert 'id="key-budget">0 of 100,000 used this month' in detail


def test_a_model_outside_the_tenants_is_not_offered_and_is_refused(world):
    tenant_limits_update(tenant=world.tenant_a, allowed_models=["acme-chat"])

    response = logged_in(world.owner_a).post(
        reverse("dashboard:key_create", args=["acme"]), {"name": "sneaky", "models": ["globex-secret-model"]}
    )

    assert response.status_code == 400
    assert "Select a valid choice" in response.content.decode()
    assert not ApiKey.objects.filter(name="sneaky").exists()


def test_admin_rotates_a_key_sees_the_new_secret_once_and_the_old_one_with_its_time_left(world):
    client = logged_in(world.admin_a)
    url = reverse("dashboard:key_rotate", args=["acme", world.key_a.pk])

    response = client.post(url, {"grace_hours": "24"})

    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    html = response.content.decode()
    raw_key = re.search(r'value="(sk-[^"]+)"', html).group(1)
    assert 'id="rotation-note"' in html and "The previous secret stays valid until" in html
    assert api_key_authenticate(raw_key=raw_key).api_key_id == world.key_a.pk
    assert api_key_authenticate(raw_key=world.raw_key_a).api_key_id == world.key_a.pk
    detail = client.get(reverse("dashboard:key_detail", args=["acme", world.key_a.pk])).content.decode()
    assert re.search(r'id="previous-secret">Valid until .* \(23 h 5\d min left\)', detail)
    assert raw_key not in detail
    listing = client.get(reverse("dashboard:keys", args=["acme"])).content.decode()
    assert "Rotated: old secret valid until" in listing


def test_a_member_cannot_rotate_and_an_outsider_gets_404(world):
    digest = world.key_a.digest
    url = reverse("dashboard:key_rotate", args=["acme", world.key_a.pk])

    member = logged_in(world.member_a).post(url, {"grace_hours": "24"})
    outsider = logged_in(world.outsider_b).post(url, {"grace_hours": "24"})
    through_b = logged_in(world.outsider_b).post(
        reverse("dashboard:key_rotate", args=["globex", world.key_a.pk]), {"grace_hours": "24"}
    )

    assert (member.status_code, outsider.status_code, through_b.status_code) == (403, 404, 404)
    assert ApiKey.objects.get(pk=world.key_a.pk).digest == digest


def test_usage_page_downloads_its_period_as_csv_for_its_tenant_only(world):
    _record(key=world.key_a, model="tiny-llama", prompt=100, completion=20)
    _record(key=world.key_a, model="tiny-llama", prompt=5_000, completion=5_000, days_ago=40)
    _record(key=world.key_b, model="globex-secret-model", prompt=777, completion=777)
    client = logged_in(world.member_a)
    page = client.get(reverse("dashboard:usage", args=["acme"]) + "?days=7").content.decode()
    link = re.search(r'href="([^"]+)" id="usage-csv"', page).group(1)

    response = client.get(link.replace("&amp;", "&"))

    assert response.status_code == 200 and response["Content-Type"] == "text/csv; charset=utf-8"
    today = timezone.now().date()
    rows = response.content.decode().splitlines()
    assert rows[1:] == [
        f"{today.isoformat()},tiny-llama,{world.key_a.display_prefix},acme-prod,1,0,100,20,0,120,120"
    ]
    assert (
        logged_in(world.outsider_b).get(reverse("dashboard:usage_export", args=["acme"])).status_code == 404
    )
