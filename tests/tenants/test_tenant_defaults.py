"""A new tenant starts with finite limits (the TENANT_DEFAULT_LIMITS setting), never unlimited by
omission: from the service, from the admin, and for a tenant whose limits row is missing."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tenants.models import Tenant, TenantLimits
from tenants.services import api_key_authenticate, api_key_create, tenant_create

pytestmark = pytest.mark.django_db

DEFAULTS = {
    "requests_per_minute": 7,
    "tokens_per_minute": 7000,
    "max_concurrent_requests": 3,
    "monthly_token_quota": 700_000,
    "max_queued_requests": 5,
    "queue_timeout_seconds": 70,
}


@pytest.fixture(autouse=True)
def _defaults(settings):
    settings.TENANT_DEFAULT_LIMITS = dict(DEFAULTS)


def _limits(tenant: Tenant) -> dict:
    limits = TenantLimits.objects.get(tenant=tenant)
    return {name: getattr(limits, name) for name in DEFAULTS}


def test_limits_not_given_are_the_defaults():
    tenant = tenant_create(name="New", slug="new", allowed_models=["m"])
    assert _limits(tenant) == DEFAULTS


def test_given_limits_win_and_none_means_unlimited():
    tenant = tenant_create(name="Big", slug="big", requests_per_minute=None, tokens_per_minute=50)
    assert _limits(tenant) == {**DEFAULTS, "requests_per_minute": None, "tokens_per_minute": 50}


def test_the_stock_defaults_are_finite():
    from django.conf import LazySettings

    stock = LazySettings()  # the settings module as configured, without this file's override
    stock_defaults = stock.TENANT_DEFAULT_LIMITS
    assert set(stock_defaults) == set(DEFAULTS)
    assert all(isinstance(value, int) and value > 0 for value in stock_defaults.values())


def test_a_tenant_without_a_limits_row_is_held_to_the_defaults():
    tenant = Tenant.objects.create(name="Bare", slug="bare")
    _, raw_key = api_key_create(tenant=tenant, name="k")

    limits = api_key_authenticate(raw_key=raw_key).tenant_limits

    assert (
        limits.requests_per_minute,
        limits.tokens_per_minute,
        limits.max_concurrent_requests,
        limits.monthly_token_quota,
        limits.max_queued_requests,
        limits.queue_timeout_seconds,
    ) == tuple(DEFAULTS.values())


def test_the_admin_add_form_starts_at_the_defaults():
    operator = get_user_model().objects.create_superuser("operator", "op@example.com", "pw")
    client = Client()
    client.force_login(operator)

    form = client.get("/admin/tenants/tenant/add/").context["inline_admin_formsets"][0].formset.forms[0]

    assert {name: form[name].value() for name in DEFAULTS} == DEFAULTS
