"""The fixture world: tenant A (an owner and a member, a key) and tenant B (an outsider, a key)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from tenants.models import ApiKey, Membership, Tenant
from tenants.services import api_key_create, membership_create, tenant_create

MODEL = "tiny-llama"


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """PBKDF2's deliberate slowness (about half a second per user here) would dominate these
    tests; what they check does not depend on the hash."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass
class World:
    tenant_a: Tenant
    tenant_b: Tenant
    owner_a: object
    member_a: object
    outsider_b: object
    key_a: ApiKey
    raw_key_a: str
    key_b: ApiKey
    raw_key_b: str


def _user(username: str):
    return get_user_model().objects.create_user(username=username, password="pw-" + username)


@pytest.fixture
def world(db) -> World:
    tenant_a = tenant_create(name="Tenant A", slug="tenant-a", allowed_models=[MODEL, "other-model"])
    tenant_b = tenant_create(name="Tenant B", slug="tenant-b", allowed_models=[MODEL])
    owner_a, member_a, outsider_b = _user("owner-a"), _user("member-a"), _user("outsider-b")
    membership_create(tenant=tenant_a, user=owner_a, role=Membership.Role.OWNER)
    membership_create(tenant=tenant_a, user=member_a, role=Membership.Role.MEMBER)
    membership_create(tenant=tenant_b, user=outsider_b, role=Membership.Role.OWNER)
    key_a, raw_key_a = api_key_create(tenant=tenant_a, name="a-key", created_by=owner_a)
    key_b, raw_key_b = api_key_create(tenant=tenant_b, name="b-key", created_by=outsider_b)
    return World(tenant_a, tenant_b, owner_a, member_a, outsider_b, key_a, raw_key_a, key_b, raw_key_b)


@pytest.fixture
def api_client() -> APIClient:
    return APIClient()


def bearer(raw_key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {raw_key}"}
