"""Who may manage a tenant's adapters is decided by the adapter services, not by the pages that
call them: owners and admins may, members may not, outsiders do not see the tenant."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from core.errors import NotFoundError, PermissionDeniedError
from inference.models import LoraAdapter
from inference.services.adapters import adapter_delete_for_member, adapter_upload_for_member
from tenants.models import Membership
from tests.helpers import PASSWORD
from tests.inference.peft_adapters import files_of

pytestmark = pytest.mark.django_db(transaction=True)


def _upload(world, user, files, name: str = "tone") -> LoraAdapter:
    return adapter_upload_for_member(
        user=user, tenant=world.tenant_a, name=name, base_model=world.model, files=files
    )


@pytest.mark.parametrize("role", [Membership.Role.OWNER, Membership.Role.ADMIN])
def test_owners_and_admins_upload_and_delete(world, adapters_dir, media_root, celery_eager, role):
    user = world.user(role)

    adapter = _upload(world, user, files_of(adapters_dir["good"]))

    adapter.refresh_from_db()
    assert (adapter.status, adapter.created_by_id) == ("ready", user.pk)
    adapter_delete_for_member(user=user, tenant_id=world.tenant_a.pk, name="tone")
    assert LoraAdapter.objects.count() == 0


def test_a_member_may_neither_upload_nor_delete(world, adapters_dir, media_root, celery_eager):
    owner, member = world.owner_a, world.member_a

    with pytest.raises(PermissionDeniedError, match="Only owners and admins can manage adapters"):
        _upload(world, member, files_of(adapters_dir["good"]), name="by-member")
    _upload(world, owner, files_of(adapters_dir["good"]))
    with pytest.raises(PermissionDeniedError):
        adapter_delete_for_member(user=member, tenant_id=world.tenant_a.pk, name="tone")

    assert list(LoraAdapter.objects.values_list("name", flat=True)) == ["tone"]


def test_an_outsider_is_told_nothing_exists(world, adapters_dir, media_root, celery_eager):
    owner, outsider = world.owner_a, world.outsider_b
    nobody = get_user_model().objects.create_user(username="nobody", password=PASSWORD)
    _upload(world, owner, files_of(adapters_dir["good"]))

    for user in (outsider, nobody):
        with pytest.raises(NotFoundError):
            _upload(world, user, files_of(adapters_dir["good"]), name="intruder")
        with pytest.raises(NotFoundError):
            adapter_delete_for_member(user=user, tenant_id=world.tenant_a.pk, name="tone")

    assert list(LoraAdapter.objects.values_list("name", flat=True)) == ["tone"]
