"""The audit log: each kind of change, made from the dashboard, the admin and the API, is an entry
naming who, when, from where, what, and the fields before and after; entries cannot be edited or
removed in the application; owners and admins see their own tenant's, nobody another's."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.models import ModelDeployment
from tenants.models import ApiKey, AuditEntry, Membership
from tenants.services import api_key_create, audit_purge
from tests.helpers import logged_in
from tests.inference.peft_adapters import files_of

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator() -> Client:
    user = get_user_model().objects.create_superuser("operator", "op@example.com", "operator-password")
    client = Client()
    client.force_login(user)
    return client


def entries(**filters) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(**filters).order_by("id"))


def _inline(prefix: str, *, total: int, initial: int = 0, minimum: int = 0, maximum: int = 1000) -> dict:
    return {
        f"{prefix}-TOTAL_FORMS": str(total),
        f"{prefix}-INITIAL_FORMS": str(initial),
        f"{prefix}-MIN_NUM_FORMS": str(minimum),
        f"{prefix}-MAX_NUM_FORMS": str(maximum),
    }


def test_dashboard_key_changes_name_the_person_the_address_and_the_fields(world):
    client = logged_in(world.owner_a)
    client.post(
        reverse("dashboard:key_create", args=[world.tenant_a.slug]), {"name": "ci", "scope": "inference"}
    )
    key = ApiKey.objects.get(name="ci")
    client.post(reverse("dashboard:key_rotate", args=[world.tenant_a.slug, key.pk]), {"grace_hours": "1"})
    client.post(reverse("dashboard:key_revoke", args=[world.tenant_a.slug, key.pk]))

    created, rotated, revoked = entries(object_type="apikey", object_id=str(key.pk))

    for entry in (created, rotated, revoked):
        assert (entry.source, entry.actor, entry.actor_user_id, entry.address) == (
            "dashboard",
            world.owner_a.username,
            world.owner_a.pk,
            "127.0.0.1",
        )
        assert (entry.tenant_id, entry.tenant_slug) == (world.tenant_a.pk, world.tenant_a.slug)
    assert created.action == "create"
    assert created.changes["name"] == [None, "ci"] and created.changes["scope"] == [None, "inference"]
    assert "digest" not in created.changes and "previous_digest" not in created.changes
    assert rotated.action == "rotate" and rotated.changes["previous_valid_until"][0] is None
    assert revoked.action == "revoke" and revoked.changes["revoked_at"][0] is None
    assert key.digest not in json.dumps([e.changes for e in entries()])


def test_admin_changes_to_limits_tiers_members_keys_and_deployments_are_logged(operator, world, settings):
    settings.MODELS_DIR = Path(world.deployment.model_path).parent
    limits = world.tenant_a.limits
    newcomer = get_user_model().objects.create_user("newcomer", password="pw")
    data = {
        "name": world.tenant_a.name,
        "slug": world.tenant_a.slug,
        "active": "on",
        **_inline("limits", total=1, initial=1, minimum=1, maximum=1),
        "limits-0-id": str(limits.pk),
        "limits-0-tenant": str(world.tenant_a.pk),
        "limits-0-requests_per_minute": "7",
        "limits-0-tokens_per_minute": str(limits.tokens_per_minute),
        "limits-0-max_concurrent_requests": str(limits.max_concurrent_requests),
        "limits-0-monthly_token_quota": str(limits.monthly_token_quota),
        "limits-0-max_queued_requests": str(limits.max_queued_requests),
        "limits-0-queue_timeout_seconds": str(limits.queue_timeout_seconds),
        "limits-0-allowed_models": json.dumps(limits.allowed_models),
        "limits-0-fair_share_weight": str(limits.fair_share_weight),
        "limits-0-service_tiers": '["default", "flex", "priority"]',
        **_inline("memberships", total=4, initial=3),
        **_inline("alert_settings", total=0, maximum=1),
        **{
            f"memberships-{i}-{field}": value
            for i, m in enumerate(Membership.objects.filter(tenant=world.tenant_a).order_by("pk"))
            for field, value in (
                ("id", str(m.pk)),
                ("tenant", str(world.tenant_a.pk)),
                ("user", str(m.user_id)),
                ("role", "admin" if m.user_id == world.member_a.pk else m.role),
            )
        },
        "memberships-3-user": str(newcomer.pk),
        "memberships-3-role": "member",
        "memberships-3-tenant": str(world.tenant_a.pk),
    }
    assert operator.post(f"/admin/tenants/tenant/{world.tenant_a.pk}/change/", data).status_code == 302
    key_change = {"name": "renamed", "allowed_models": "null", "scope": "inference"}
    assert operator.post(f"/admin/tenants/apikey/{world.key_a.pk}/change/", key_change).status_code == 302
    deployment = world.deployment
    deployment_form = {
        "name": deployment.name,
        "model_path": deployment.model_path,
        "task": deployment.task,
        "max_model_len": str(deployment.max_model_len // 2),
        "dtype": deployment.dtype,
        "tool_call_parser": deployment.tool_call_parser,
        "reasoning_parser": deployment.reasoning_parser,
        "engine_settings": json.dumps(deployment.engine_settings),
        "prefix_routing": "on",
        "replica_wait_seconds": "0",
        "enabled": "on",
    }
    response = operator.post(f"/admin/inference/modeldeployment/{deployment.pk}/change/", deployment_form)
    assert response.status_code == 302, re.findall(
        r'class="errorlist[^"]*"[^>]*>(.*?)</ul>', response.content.decode(), re.S
    )

    by_admin = entries(source="admin")
    assert {e.actor for e in by_admin} == {"operator"} and {e.address for e in by_admin} == {"127.0.0.1"}
    found = {(e.object_type, e.action): e for e in by_admin}
    assert found["tenantlimits", "update"].changes == {
        "requests_per_minute": [limits.requests_per_minute, 7],
        "service_tiers": [limits.service_tiers, ["default", "flex", "priority"]],
    }
    assert found["membership", "update"].changes == {"role": ["member", "admin"]}
    assert found["membership", "create"].changes["user"] == [None, newcomer.pk]
    assert found["apikey", "update"].changes == {
        "name": [world.key_a.name, "renamed"],
        "scope": ["all", "inference"],
    }
    assert found["modeldeployment", "update"].changes == {
        "max_model_len": [deployment.max_model_len, deployment.max_model_len // 2]
    }
    assert found["modeldeployment", "update"].tenant_id is None
    assert {e.tenant_id for e in by_admin if e.object_type != "modeldeployment"} == {world.tenant_a.pk}


def test_an_adapter_uploaded_and_deleted_with_a_key_names_the_key(
    world, adapters_dir, media_root, celery_eager
):
    data = {"name": "support-tone", "base_model": world.model, "file": files_of(adapters_dir["good"])}
    assert Client().post("/v1/adapters", data, headers=world.headers()).status_code == 201
    assert Client().delete("/v1/adapters/support-tone", headers=world.headers()).status_code == 200

    uploaded, deleted = entries(object_type="loraadapter")

    for entry in (uploaded, deleted):
        assert (entry.source, entry.actor, entry.actor_api_key_id, entry.actor_user_id) == (
            "api",
            f"key {world.key_a.display_prefix}",
            world.key_a.pk,
            None,
        )
        assert entry.address == "127.0.0.1" and entry.tenant_id == world.tenant_a.pk
    assert (uploaded.action, uploaded.changes["name"]) == ("create", [None, "support-tone"])
    assert (deleted.action, deleted.changes["name"]) == ("delete", ["support-tone", None])


def test_entries_cannot_be_edited_or_removed_in_the_admin_or_the_application(operator, world):
    api_key_create(tenant=world.tenant_a, name="logged")
    entry = entries()[-1]

    page = operator.get(f"/admin/tenants/auditentry/{entry.pk}/change/").content.decode()
    edit = operator.post(f"/admin/tenants/auditentry/{entry.pk}/change/", {"action": "nothing"})
    remove = operator.post(f"/admin/tenants/auditentry/{entry.pk}/delete/", {"post": "yes"})
    add = operator.get("/admin/tenants/auditentry/add/")

    assert "logged" in page and 'name="_save"' not in page
    assert (edit.status_code, remove.status_code, add.status_code) == (403, 403, 403)
    entry.action = "forged"
    with pytest.raises(TypeError, match="append-only"):
        entry.save()
    with pytest.raises(TypeError, match="append-only"):
        entry.delete()
    with pytest.raises(TypeError, match="append-only"):
        AuditEntry.objects.filter(pk=entry.pk).update(action="forged")
    with pytest.raises(TypeError, match="append-only"):
        AuditEntry.objects.filter(pk=entry.pk).delete()
    assert AuditEntry.objects.get(pk=entry.pk).action == "create"


def test_the_admin_exports_the_selected_entries_as_csv(operator, world):
    api_key_create(tenant=world.tenant_a, name="=cmd|' /C calc'!A0")
    entry = entries()[-1]

    response = operator.post(
        "/admin/tenants/auditentry/", {"action": "export_csv", "_selected_action": [str(entry.pk)]}
    )

    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert rows[0][:6] == ["time", "tenant", "source", "actor", "address", "action"]
    assert rows[1][1:8] == [
        world.tenant_a.slug,
        "system",
        "system",
        "",
        "create",
        "apikey",
        str(entry.object_id),
    ]
    assert rows[1][8] == "'" + entry.object_repr  # inert in a spreadsheet


def test_owners_and_admins_see_their_tenants_entries_members_may_not_and_outsiders_get_404(world):
    api_key_create(tenant=world.tenant_a, name="a-key")
    api_key_create(tenant=world.tenant_b, name="b-key")
    url = reverse("dashboard:audit", args=[world.tenant_a.slug])

    owner = logged_in(world.owner_a).get(url)
    admin = logged_in(world.admin_a).get(url)
    member = logged_in(world.member_a).get(url)
    outsider = logged_in(world.outsider_b).get(url)
    exported = logged_in(world.admin_a).get(reverse("dashboard:audit_export", args=[world.tenant_a.slug]))

    assert owner.status_code == admin.status_code == 200
    assert "a-key" in owner.content.decode() and "b-key" not in owner.content.decode()
    assert (member.status_code, outsider.status_code) == (403, 404)
    assert (
        'id="nav-audit"'
        not in logged_in(world.member_a)
        .get(reverse("dashboard:overview", args=[world.tenant_a.slug]))
        .content.decode()
    )
    names = [row[8] for row in csv.reader(io.StringIO(exported.content.decode()))][1:]
    assert any("a-key" in n for n in names) and not any("b-key" in n for n in names)


def test_the_retention_purge_removes_only_entries_past_the_retention(world, settings):
    settings.AUDIT_RETENTION_DAYS = 30
    now = timezone.now()
    old = AuditEntry.objects.create(
        created_at=now - timedelta(days=31), source="system", actor="system", action="create",
        object_type="apikey", object_id="1", object_repr="old",
    )  # fmt: skip
    recent = AuditEntry.objects.create(
        created_at=now - timedelta(days=29), source="system", actor="system", action="create",
        object_type="apikey", object_id="2", object_repr="recent",
    )  # fmt: skip

    assert audit_purge(now=now) == 1

    assert not AuditEntry.objects.filter(pk=old.pk).exists()
    assert AuditEntry.objects.filter(pk=recent.pk).exists()


def test_an_update_that_changes_nothing_writes_no_entry(operator, world, settings):
    settings.MODELS_DIR = Path(world.deployment.model_path).parent
    deployment = ModelDeployment.objects.get(pk=world.deployment.pk)
    before = AuditEntry.objects.count()
    form = {
        "name": deployment.name,
        "model_path": deployment.model_path,
        "task": deployment.task,
        "max_model_len": str(deployment.max_model_len),
        "dtype": deployment.dtype,
        "tool_call_parser": deployment.tool_call_parser,
        "reasoning_parser": deployment.reasoning_parser,
        "engine_settings": json.dumps(deployment.engine_settings),
        "prefix_routing": "on" if deployment.prefix_routing else "",
        "replica_wait_seconds": str(deployment.replica_wait_seconds),
        "enabled": "on",
    }
    if deployment.max_queued_requests is not None:
        form["max_queued_requests"] = str(deployment.max_queued_requests)

    assert operator.post(f"/admin/inference/modeldeployment/{deployment.pk}/change/", form).status_code == 302

    assert AuditEntry.objects.count() == before
