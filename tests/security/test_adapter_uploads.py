"""Adapter uploads are bounded before they are parsed, every parse failure ends as `failed` with a
reason (never `validating` for ever), and a tenant's adapters fit its storage."""

from __future__ import annotations

import json
import struct

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from core.errors import InvalidRequestError
from inference.models import LoraAdapter
from inference.services import adapter_files
from inference.services.adapters import adapter_upload, adapter_validate
from tests.inference.peft_adapters import files_of, files_on_disk, zip_bytes, zip_of

pytestmark = pytest.mark.django_db(transaction=True)

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _upload(world, files, name: str = "tone") -> LoraAdapter:
    return adapter_upload(tenant=world.tenant_a, name=name, base_model=world.model, files=files)


def _files(adapters_dir, *, config: bytes | None = None, weights: bytes | None = None):
    good = adapters_dir["good"]
    return [
        SimpleUploadedFile(CONFIG, config if config is not None else (good / CONFIG).read_bytes()),
        SimpleUploadedFile(WEIGHTS, weights if weights is not None else (good / WEIGHTS).read_bytes()),
    ]


def test_an_archive_with_too_many_entries_is_refused_unread(world, adapters_dir, media_root):
    entries = {f"junk/{i}.txt": b"x" for i in range(adapter_files.MAX_ARCHIVE_ENTRIES)}
    entries.update({CONFIG: b"{}", WEIGHTS: b"\0" * 16})

    with pytest.raises(InvalidRequestError) as refused:
        _upload(world, [SimpleUploadedFile("a.zip", zip_bytes(entries))])

    assert refused.value.code == "unsafe_archive" and "at most 16" in refused.value.message
    assert files_on_disk(media_root) == [] and not LoraAdapter.objects.exists()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (struct.pack("<Q", 64 * 1024 * 1024) + b"{", "declares a header of"),
        (struct.pack("<Q", 10**12) + b"{}", "header length is wrong"),
        (b"\x01", "header length is wrong"),
    ],
)
def test_a_safetensors_header_is_measured_before_it_is_parsed(
    world, adapters_dir, media_root, header, message
):
    weights = header + b"\0" * (64 * 1024 * 1024 if "declares" in message else 0)

    with pytest.raises(InvalidRequestError) as refused:
        _upload(world, _files(adapters_dir, weights=weights))

    assert refused.value.code == "invalid_safetensors" and message in refused.value.message
    assert not LoraAdapter.objects.exists()


def test_a_config_nested_too_deeply_fails_with_a_reason(world, adapters_dir, media_root, celery_eager):
    deep = b"[" * 100_000 + b"]" * 100_000

    _upload(world, _files(adapters_dir, config=deep))

    adapter = LoraAdapter.objects.get()
    assert adapter.status == "failed"
    assert "nested too deeply" in adapter.failure_reason


def test_an_unexpected_failure_of_the_checks_ends_failed_not_validating(
    world, adapters_dir, media_root, celery_eager, monkeypatch
):
    from inference.services import adapters

    def broken(**kwargs):
        raise MemoryError("the checks blew up")

    monkeypatch.setattr(adapters, "adapter_check", broken)
    adapter = _upload(world, files_of(adapters_dir["good"]))

    adapter.refresh_from_db()
    assert adapter.status == "failed"
    assert "could not be checked" in adapter.failure_reason and "blew up" not in adapter.failure_reason
    # Decided: validating it again (the lost-validation sweep) changes nothing.
    assert adapter_validate(adapter_id=adapter.pk, version=adapter.version) == "failed"


def test_a_tenants_adapters_fit_its_storage(world, adapters_dir, media_root, settings):
    one = sum(len((adapters_dir["good"] / n).read_bytes()) for n in (CONFIG, WEIGHTS))
    settings.ADAPTER_STORAGE_PER_TENANT = 2 * one

    _upload(world, files_of(adapters_dir["good"]), name="first")
    _upload(world, files_of(adapters_dir["good"]), name="second")
    _upload(
        world, [SimpleUploadedFile("a.zip", zip_of(adapters_dir["good"]))], name="second"
    )  # a new version
    with pytest.raises(InvalidRequestError) as refused:
        _upload(world, files_of(adapters_dir["good"]), name="third")

    assert refused.value.code == "adapter_storage_quota"
    assert sorted(LoraAdapter.objects.values_list("name", flat=True)) == ["first", "second"]
    assert not [p for p in files_on_disk(media_root) if "third" in str(p)]
    assert json.loads((adapters_dir["good"] / CONFIG).read_text())  # the source files are untouched
