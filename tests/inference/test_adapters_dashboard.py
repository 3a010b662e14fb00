"""Uploading and deleting adapters from the tenant dashboard and from the admin."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile

from inference.models import LoraAdapter
from tests.helpers import logged_in
from tests.inference.peft_adapters import (
    files_of,
    files_on_disk,
    zip_bytes,
)

pytestmark = pytest.mark.django_db(transaction=True)


def page(world) -> str:
    return f"/dashboard/t/{world.tenant_a.slug}/adapters/"


def test_owner_uploads_an_adapter_that_becomes_ready(world, adapters_dir, media_root, celery_eager):
    client = logged_in(world.owner_a)

    response = client.post(
        page(world) + "new/",
        {"name": "support-tone", "base_model": world.model, "files": files_of(adapters_dir["good"])},
    )

    assert response.status_code == 302
    assert response["Location"] == page(world)
    adapter = LoraAdapter.objects.get()
    assert (adapter.tenant_id, adapter.name, adapter.status, adapter.created_by.username) == (
        world.tenant_a.pk,
        "support-tone",
        "ready",
        world.owner_a.username,
    )
    listing = client.get(page(world))
    assert listing.status_code == 200
    html = listing.content.decode()
    assert 'data-adapter="support-tone"' in html
    assert '<span class="badge badge-ok adapter-status">Ready</span>' in html
    assert "was uploaded; it is being validated." in html


def test_failed_adapter_shows_its_reason(world, adapters_dir, media_root, celery_eager):
    client = logged_in(world.admin_a)

    client.post(
        page(world) + "new/",
        {"name": "big", "base_model": world.model, "files": files_of(adapters_dir["rank-128"])},
    )

    html = client.get(page(world)).content.decode()
    assert '<span class="badge badge-danger adapter-status">Failed</span>' in html
    assert "The adapter&#x27;s rank r=128 is above the maximum rank 64 this base model serves." in html


def test_refused_upload_shows_the_reason_and_keeps_nothing(world, media_root):
    client = logged_in(world.owner_a)
    archive = SimpleUploadedFile("a.zip", zip_bytes({"../adapter_config.json": b"{}"}))

    response = client.post(
        page(world) + "new/", {"name": "escape", "base_model": world.model, "files": [archive]}
    )

    assert response.status_code == 400
    assert "points outside the archive&#x27;s folder" in response.content.decode()
    assert LoraAdapter.objects.count() == 0
    assert files_on_disk(media_root) == []


def test_base_models_offered_are_the_tenants(world):
    client = logged_in(world.owner_a)

    response = client.get(page(world))

    assert response.context["form"].fields["base_model"].choices == [(world.model, world.model)]


def test_member_sees_the_list_but_cannot_upload_or_delete(world, adapters_dir, media_root, celery_eager):
    client = logged_in(world.member_a)

    upload = client.post(
        page(world) + "new/",
        {"name": "x", "base_model": world.model, "files": files_of(adapters_dir["good"])},
    )

    assert upload.status_code == 403
    assert LoraAdapter.objects.count() == 0
    assert 'id="read-only-note"' in client.get(page(world)).content.decode()


def test_owner_deletes_an_adapter_after_confirming(world, adapters_dir, media_root, celery_eager):
    client = logged_in(world.owner_a)
    client.post(
        page(world) + "new/",
        {"name": "tone", "base_model": world.model, "files": files_of(adapters_dir["good"])},
    )

    confirm = client.get(page(world) + "tone/delete/")
    deleted = client.post(page(world) + "tone/delete/")

    assert confirm.status_code == 200
    assert deleted.status_code == 302
    assert LoraAdapter.objects.count() == 0
    assert files_on_disk(media_root) == []


def test_outsider_gets_404_for_the_tenants_adapter_pages(world, adapters_dir, media_root, celery_eager):
    logged_in(world.owner_a).post(
        page(world) + "new/",
        {"name": "tone", "base_model": world.model, "files": files_of(adapters_dir["good"])},
    )
    outsider = logged_in(world.outsider_b)
    # The outsider's own tenant URL cannot reach A's adapter by name either.
    own_page = f"/dashboard/t/{world.tenant_b.slug}/adapters/"

    assert outsider.get(page(world)).status_code == 404
    assert outsider.post(page(world) + "tone/delete/").status_code == 404
    assert outsider.post(own_page + "tone/delete/").status_code == 404
    assert 'data-adapter="tone"' not in outsider.get(own_page).content.decode()
    assert LoraAdapter.objects.count() == 1


def test_admin_uploads_an_adapter_for_a_tenant(world, adapters_dir, media_root, celery_eager):
    admin = get_user_model().objects.create_superuser(
        username="root", password="pw", email="root@example.com"
    )
    client = logged_in(admin)

    form = client.get("/admin/inference/loraadapter/add/")
    response = client.post(
        "/admin/inference/loraadapter/add/",
        {
            "tenant": world.tenant_b.pk,
            "name": "ops-tone",
            "base_model": world.model,
            "files": files_of(adapters_dir["good"]),
        },
    )

    assert form.status_code == 200
    adapter = LoraAdapter.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/admin/inference/loraadapter/{adapter.pk}/change/"
    assert (adapter.tenant_id, adapter.status) == (world.tenant_b.pk, "ready")
    assert client.get(response["Location"]).status_code == 200

    refused = client.post(
        "/admin/inference/loraadapter/add/",
        {
            "tenant": world.tenant_b.pk,
            "name": "pickled",
            "base_model": world.model,
            "files": [SimpleUploadedFile("adapter_model.bin", b"\x80\x04")],
        },
    )
    assert refused.status_code == 400
    assert "is a pickle file" in refused.content.decode()
    assert LoraAdapter.objects.count() == 1

    client.post(f"/admin/inference/loraadapter/{adapter.pk}/delete/", {"post": "yes"})
    assert LoraAdapter.objects.count() == 0
    assert files_on_disk(media_root) == []
