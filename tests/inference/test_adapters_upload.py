"""POST /v1/adapters: real PEFT adapters uploaded with a tenant key, validated by the Celery task
(run in the calling thread), and the uploads that are refused outright with nothing kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from inference.models import LoraAdapter
from inference.services.adapters import adapter_validate
from tests.inference.peft_adapters import (
    CONFIG,
    WEIGHTS,
    files_of,
    files_on_disk,
    zip_bytes,
    zip_of,
)

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/adapters"


def upload(
    world,
    files: list[SimpleUploadedFile],
    *,
    name: str = "support-tone",
    base_model: str | None = None,
    raw_key: str | None = None,
):
    data = {"name": name, "base_model": base_model or world.model, "file": files}
    return Client().post(URL, data, headers=world.headers(raw_key))


def listed(world, raw_key: str | None = None) -> list[dict]:
    response = Client().get(URL, headers=world.headers(raw_key))
    assert response.status_code == 200
    return response.json()["data"]


def assert_nothing_kept(media: Path) -> None:
    assert LoraAdapter.objects.count() == 0
    assert files_on_disk(media) == []
    assert not (media / "adapters").exists() or list((media / "adapters").rglob("*")) == []


def test_good_adapter_uploaded_as_two_files_becomes_ready(world, adapters_dir, media_root, celery_eager):
    response = upload(world, files_of(adapters_dir["good"]))

    assert response.status_code == 201
    created = response.json()
    adapter = LoraAdapter.objects.get()
    version_dir = media_root / "adapters" / world.tenant_a.slug / "support-tone" / adapter.version
    assert created == {
        "id": "support-tone",
        "object": "adapter",
        "created": int(adapter.created_at.timestamp()),
        "base_model": world.model,
        "status": "uploaded",
        "failure_reason": None,
        "version": adapter.version,
        "rank": None,
        "lora_alpha": None,
        "target_modules": [],
        "bytes": adapter.size_bytes,
    }
    # The task ran when the upload committed.
    [row] = listed(world)
    assert (row["status"], row["failure_reason"], row["rank"], row["lora_alpha"]) == ("ready", None, 8, 16.0)
    assert row["target_modules"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert adapter.storage_path == str(version_dir)
    assert files_on_disk(media_root) == [version_dir / CONFIG, version_dir / WEIGHTS]
    assert (version_dir / WEIGHTS).read_bytes() == (adapters_dir["good"] / WEIGHTS).read_bytes()
    assert adapter.size_bytes == sum((adapters_dir["good"] / n).stat().st_size for n in (CONFIG, WEIGHTS))


@pytest.mark.django_db(transaction=False)
def test_upload_schedules_validation_when_it_commits(
    world, adapters_dir, media_root, celery_eager, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = upload(world, files_of(adapters_dir["good"]))
    assert response.status_code == 201
    # Nothing was validated yet: the task is queued when the transaction commits.
    assert LoraAdapter.objects.get().status == "uploaded"

    for callback in callbacks:
        callback()

    assert LoraAdapter.objects.get().status == "ready"


def test_zip_holding_the_two_files_in_a_folder_becomes_ready(world, adapters_dir, media_root, celery_eager):
    archive = SimpleUploadedFile("support-tone.zip", zip_of(adapters_dir["good"]))

    response = upload(world, [archive])

    assert response.status_code == 201
    adapter = LoraAdapter.objects.get()
    assert adapter.status == "ready"
    version_dir = Path(adapter.storage_path)
    assert files_on_disk(media_root) == [version_dir / CONFIG, version_dir / WEIGHTS]


def test_adapter_trained_on_another_base_model_fails_with_the_reason(
    world, adapters_dir, media_root, celery_eager
):
    response = upload(world, files_of(adapters_dir["other-base"]))

    assert response.status_code == 201
    adapter = LoraAdapter.objects.get()
    assert adapter.status == "failed"
    trained_on = json.loads((adapters_dir["other-base"] / CONFIG).read_text())["base_model_name_or_path"]
    assert adapter.failure_reason == (
        "Tensor `base_model.model.model.layers.0.mlp.down_proj.lora_A.weight` has shape [8, 88], but the base "
        f"model `{world.model}` with r=8 needs [8, 176] (lora_A is (r, in_features) of down_proj). "
        f"(27 more tensors do not fit either.) The adapter names {trained_on!r} as its base model: was it "
        "trained on a different one?"
    )
    assert adapter.rank is None
    [row] = listed(world)
    assert (row["status"], row["failure_reason"]) == ("failed", adapter.failure_reason)


def test_adapter_with_a_wrongly_shaped_tensor_fails_naming_it(world, adapters_dir, media_root, celery_eager):
    upload(world, files_of(adapters_dir["bad-shape"]))

    adapter = LoraAdapter.objects.get()
    assert adapter.status == "failed"
    assert adapter.failure_reason == (
        "Tensor `base_model.model.model.layers.1.mlp.down_proj.lora_A.weight` has shape [8, 64], but the base "
        f"model `{world.model}` with r=8 needs [8, 176] (lora_A is (r, in_features) of down_proj). "
        "27 of its 28 tensors fit, so the weights file looks damaged or edited: save the adapter again with PEFT."
    )


def test_adapter_above_the_max_rank_fails_with_the_reason(world, adapters_dir, media_root, celery_eager):
    upload(world, files_of(adapters_dir["rank-128"]))

    adapter = LoraAdapter.objects.get()
    assert (adapter.status, adapter.failure_reason) == (
        "failed",
        "The adapter's rank r=128 is above the maximum rank 64 this base model serves. "
        "Train the adapter again with r <= 64.",
    )


def test_the_deployment_max_lora_rank_is_the_limit(world, adapters_dir, media_root, celery_eager):
    world.deployment.engine_settings = {"max_lora_rank": 4}
    world.deployment.save()

    upload(world, files_of(adapters_dir["good"]))

    assert LoraAdapter.objects.get().failure_reason.startswith(
        "The adapter's rank r=8 is above the maximum rank 4 "
    )


def test_config_that_is_not_lora_fails_with_the_reason(world, adapters_dir, media_root, celery_eager):
    config = json.loads((adapters_dir["good"] / CONFIG).read_text()) | {"peft_type": "IA3"}
    files = [
        SimpleUploadedFile(CONFIG, json.dumps(config).encode()),
        SimpleUploadedFile(WEIGHTS, (adapters_dir["good"] / WEIGHTS).read_bytes()),
    ]

    upload(world, files)

    assert LoraAdapter.objects.get().failure_reason == (
        "adapter_config.json has peft_type 'IA3'; only LoRA adapters (peft_type \"LORA\") can be served."
    )


def test_pickle_weights_are_refused_and_nothing_is_kept(world, adapters_dir, media_root, celery_eager):
    files = [
        SimpleUploadedFile(CONFIG, (adapters_dir["good"] / CONFIG).read_bytes()),
        SimpleUploadedFile("adapter_model.bin", b"\x80\x04\x95 pickled"),
    ]

    response = upload(world, files)

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "`adapter_model.bin` is a pickle file, which is never loaded here. Save the adapter as "
            "safetensors: PEFT's save_pretrained(...) writes adapter_model.safetensors by default.",
            "type": "invalid_request_error",
            "param": "file",
            "code": "pickle_refused",
        }
    }
    assert_nothing_kept(media_root)


def test_pickle_named_like_safetensors_is_refused_and_nothing_is_kept(world, adapters_dir, media_root):
    files = [
        SimpleUploadedFile(CONFIG, (adapters_dir["good"] / CONFIG).read_bytes()),
        SimpleUploadedFile(WEIGHTS, b"\x80\x04\x95" + b"\x00" * 64),
    ]

    response = upload(world, files)

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_safetensors", "file")
    assert error["message"].startswith("adapter_model.safetensors is not a valid safetensors file (")
    assert_nothing_kept(media_root)


def test_pickle_inside_a_zip_is_refused_and_nothing_is_kept(world, adapters_dir, media_root):
    archive = zip_bytes({f"a/{CONFIG}": b"{}", f"a/{WEIGHTS}": b"", "a/training_args.bin": b"\x80\x04"})

    response = upload(world, [SimpleUploadedFile("a.zip", archive)])

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "pickle_refused"
    assert response.json()["error"]["message"].startswith("`training_args.bin` is a pickle file")
    assert_nothing_kept(media_root)


@pytest.mark.parametrize("entry", ["../adapter_model.safetensors", "a/../../evil.txt", "/etc/evil.txt"])
def test_zip_with_paths_out_of_its_folder_is_refused_and_nothing_is_kept(
    world, adapters_dir, media_root, entry: str
):
    entries = {f"a/{n}": (adapters_dir["good"] / n).read_bytes() for n in (CONFIG, WEIGHTS)}
    archive = zip_bytes({**entries, entry: b"escaped"})

    response = upload(world, [SimpleUploadedFile("a.zip", archive)])

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": f"The archive entry `{entry}` points outside the archive's folder (an absolute path, "
            "`..`, or a link); the archive is refused.",
            "type": "invalid_request_error",
            "param": "file",
            "code": "unsafe_archive",
        }
    }
    assert_nothing_kept(media_root)
    assert not (media_root.parent / "evil.txt").exists()


def test_oversize_upload_is_refused_and_nothing_is_kept(world, adapters_dir, media_root, settings):
    settings.ADAPTER_MAX_BYTES = 4096

    response = upload(world, files_of(adapters_dir["good"]))

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "The adapter is larger than the limit of 4096 bytes.",
            "type": "invalid_request_error",
            "param": "file",
            "code": "adapter_too_large",
        }
    }
    assert_nothing_kept(media_root)


def test_oversize_request_is_refused_before_its_files_are_parsed(world, adapters_dir, media_root, settings):
    settings.ADAPTER_MAX_BYTES = 1

    response = upload(world, [SimpleUploadedFile(WEIGHTS, b"\x00" * 200_000)])

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "adapter_too_large"
    assert_nothing_kept(media_root)


def test_zip_that_unpacks_past_the_limit_is_refused_and_nothing_is_kept(world, media_root, settings):
    settings.ADAPTER_MAX_BYTES = 100_000
    # Zeros compress about a thousandfold: the archive is small, its content is not.
    archive = zip_bytes({CONFIG: b"{}", WEIGHTS: b"\x00" * 1_000_000})
    assert len(archive) < 10_000

    response = upload(world, [SimpleUploadedFile("a.zip", archive)])

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "adapter_too_large"
    assert_nothing_kept(media_root)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ([CONFIG], "Unexpected files (`adapter_config.json`)."),
        (
            [CONFIG, WEIGHTS, "README.md"],
            "Unexpected files (`adapter_config.json`, `adapter_model.safetensors`, `README.md`).",
        ),
    ],
)
def test_upload_without_exactly_the_two_peft_files_is_refused(
    world, adapters_dir, media_root, names, message
):
    files = [SimpleUploadedFile(n, b"{}") for n in names]

    response = upload(world, files)

    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        f"{message} Upload adapter_config.json and adapter_model.safetensors (two files), or one .zip holding them."
    )
    assert_nothing_kept(media_root)


@pytest.mark.parametrize(
    ("name", "base", "param", "code"),
    [
        ("../escape", None, "name", "invalid_name"),
        (".hidden", None, "name", "invalid_name"),
        ("ok-name", "b-only-model", "base_model", "model_not_found"),
        ("ok-name", "no-such-model", "base_model", "model_not_found"),
    ],
)
def test_bad_name_or_base_model_is_refused(world, adapters_dir, media_root, name, base, param, code):
    response = upload(world, files_of(adapters_dir["good"]), name=name, base_model=base)

    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, code)
    assert_nothing_kept(media_root)


def test_adapter_named_like_a_model_of_the_tenant_is_refused(world, adapters_dir, media_root):
    response = upload(world, files_of(adapters_dir["good"]), name=world.model)

    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        f"`{world.model}` is the name of a model your tenant uses; give the adapter another name."
    )
    assert_nothing_kept(media_root)


def test_reupload_switches_to_a_new_version_and_keeps_only_the_one_before(
    world, adapters_dir, media_root, celery_eager
):
    upload(world, files_of(adapters_dir["good"]))
    first = LoraAdapter.objects.get()
    upload(world, files_of(adapters_dir["attention-r4"]))
    second = LoraAdapter.objects.get()

    assert second.pk == first.pk
    assert second.version != first.version
    assert (second.status, second.rank, second.target_modules) == ("ready", 4, ["q_proj", "v_proj"])
    home = media_root / "adapters" / world.tenant_a.slug / "support-tone"
    # The version replaced stays for requests queued against it just before the switch.
    assert sorted(p.name for p in home.iterdir()) == sorted([first.version, second.version])

    upload(world, files_of(adapters_dir["good"]))
    third = LoraAdapter.objects.get()

    assert sorted(p.name for p in home.iterdir()) == sorted([second.version, third.version])
    assert third.rank == 8


def test_refused_reupload_leaves_the_ready_adapter_as_it_was(world, adapters_dir, media_root, celery_eager):
    upload(world, files_of(adapters_dir["good"]))
    before = LoraAdapter.objects.get()
    disk_before = files_on_disk(media_root)

    response = upload(world, [SimpleUploadedFile("a.zip", zip_bytes({"../x": b""}))])

    assert response.status_code == 400
    after = LoraAdapter.objects.get()
    assert (after.version, after.status, after.storage_path, after.updated_at) == (
        before.version,
        "ready",
        before.storage_path,
        before.updated_at,
    )
    assert files_on_disk(media_root) == disk_before


def test_validation_of_a_replaced_version_changes_nothing(world, adapters_dir, media_root, celery_eager):
    upload(world, files_of(adapters_dir["good"]))
    adapter = LoraAdapter.objects.get()

    assert adapter_validate(adapter_id=adapter.pk, version="some-older-version") == "superseded"
    assert adapter_validate(adapter_id=adapter.pk, version=adapter.version) == "ready"
    assert LoraAdapter.objects.get().updated_at == adapter.updated_at


def test_upload_needs_a_key(world, adapters_dir, media_root):
    response = Client().post(
        URL, {"name": "x", "base_model": world.model, "file": files_of(adapters_dir["good"])}
    )

    assert response.status_code == 401
    assert_nothing_kept(media_root)


def test_adapters_whose_validation_was_lost_are_validated_again(
    world, adapters_dir, media_root, celery_eager
):
    from datetime import timedelta

    from django.utils import timezone

    from inference.tasks import adapter_validate_lost

    upload(world, files_of(adapters_dir["good"]))
    adapter = LoraAdapter.objects.get()
    # As if the broker had been down at upload: the task never ran.
    LoraAdapter.objects.filter(pk=adapter.pk).update(status="uploaded", updated_at=timezone.now())
    assert adapter_validate_lost.delay().get() == 0
    LoraAdapter.objects.filter(pk=adapter.pk).update(updated_at=timezone.now() - timedelta(minutes=11))

    assert adapter_validate_lost.delay().get() == 1

    assert LoraAdapter.objects.get().status == "ready"
