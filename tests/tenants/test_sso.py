"""Single sign-on users (tenants.services.sso): one user per identity (issuer, subject), created at
its first sign-in, whose tenants, roles and staff flag are what the claims say at each sign-in."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from tenants.models import AuditEntry, Membership, SsoIdentity
from tenants.services.sso import sso_roles, sso_user_for, sso_user_sync

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _sso(settings):
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = "https://idp.example/o/authorize/"
    settings.SSO_ISSUER = ""


def roles(user) -> dict[str, str]:
    return dict(Membership.objects.filter(user=user).values_list("tenant__slug", "role"))


def test_a_first_sign_in_without_the_claim_creates_a_user_with_no_access(world):
    user = sso_user_sync(claims={"sub": "u-1", "email": "new@idp.example", "preferred_username": "newcomer"})

    assert (user.username, user.email, user.has_usable_password()) == ("newcomer", "new@idp.example", False)
    assert (user.is_staff, user.is_superuser) == (False, False)
    assert roles(user) == {}
    identity = SsoIdentity.objects.get(user=user)
    assert (identity.issuer, identity.subject) == ("https://idp.example", "u-1")


def test_the_claim_grants_tenants_and_roles_and_each_sign_in_applies_it_again(world):
    claims = {"sub": "u-2", "preferred_username": "ana", "pagoda_tenants": [f"{world.tenant_a.slug}:admin"]}
    user = sso_user_sync(claims=claims)
    assert roles(user) == {world.tenant_a.slug: "admin"}

    claims["pagoda_tenants"] = [
        {"tenant": world.tenant_b.slug, "role": "member"},
        "nope:owner",
        "x:emperor",
        7,
    ]
    user = sso_user_sync(claims=claims, user=sso_user_for(claims=claims))

    assert roles(user) == {world.tenant_b.slug: "member"}
    by_sso = AuditEntry.objects.filter(object_type="membership", actor="sso:https://idp.example")
    assert list(by_sso.order_by("id").values_list("action", "tenant_slug")) == [
        ("create", world.tenant_a.slug),
        ("delete", world.tenant_a.slug),
        ("create", world.tenant_b.slug),
    ]


def test_the_staff_claim_opens_the_admin_and_its_absence_closes_it(world):
    claims = {"sub": "u-3", "preferred_username": "op", "pagoda_staff": True}
    user = sso_user_sync(claims=claims)
    assert (user.is_staff, user.is_superuser) == (True, True)

    user = sso_user_sync(claims={"sub": "u-3"}, user=user)

    user.refresh_from_db()
    assert (user.is_staff, user.is_superuser) == (False, False)


def test_an_identity_is_matched_by_its_subject_never_by_an_e_mail_address(world):
    world.owner_a.email = "owner@a.example"
    world.owner_a.save(update_fields=["email"])
    claims = {"sub": "someone-else", "email": "owner@a.example", "preferred_username": world.owner_a.username}

    assert sso_user_for(claims=claims) is None
    user = sso_user_sync(claims=claims)

    assert user.pk != world.owner_a.pk and user.username == f"{world.owner_a.username}-2"
    assert get_user_model().objects.get(pk=world.owner_a.pk).has_usable_password()


def test_roles_read_from_strings_and_objects_and_skip_the_rest(settings):
    settings.SSO_TENANTS_CLAIM = "groups"
    claims = {"groups": ["acme:owner", {"tenant": "globex", "role": "member"}, "bad", {"tenant": "x"}, None]}

    assert sso_roles(claims) == {"acme": "owner", "globex": "member"}
