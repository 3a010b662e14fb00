"""The admin cannot point an engine at any path of the host, and its actions that schedule work
need the change permission, not only view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

from inference.models import LoraAdapter, ModelDeployment
from tenants.services import tenant_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("op", "op@example.com", "pw"))
    return client


@pytest.fixture
def models_dir(settings, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.json").write_text("{}")
    settings.MODELS_DIR = root
    return root


def _add(operator: Client, model_path: str, engine_settings: str = "{}", task: str = "generate"):
    return operator.post(
        "/admin/inference/modeldeployment/add/",
        {
            "name": "tiny",
            "model_path": model_path,
            "task": task,
            "max_model_len": "256",
            "dtype": "auto",
            "engine_settings": engine_settings,
            "replica_wait_seconds": "0",
            "enabled": "on",
        },
    )


@pytest.mark.parametrize(
    "path", ["/etc", "{root}/../elsewhere", "{root}/tiny/../../elsewhere", "../elsewhere"]
)
def test_a_model_path_outside_the_models_dir_is_refused(operator, models_dir, path):
    response = _add(operator, path.format(root=models_dir))

    assert response.status_code == 200  # the form again, with the error
    assert "must be inside PAGODA_MODELS_DIR" in response.content.decode()
    assert not ModelDeployment.objects.exists()


@pytest.mark.parametrize("path", ["{root}/tiny", "tiny"])
def test_a_model_path_inside_the_models_dir_is_stored_resolved(operator, models_dir, path):
    response = _add(operator, path.format(root=models_dir))

    assert response.status_code == 302
    assert ModelDeployment.objects.get().model_path == str((models_dir / "tiny").resolve())


def test_the_task_is_the_operators_where_the_checkpoint_allows_it(operator, models_dir):
    """A decoder may be set to embed (an embedding model built on it); an encoder only embeds, so
    the admin stores embed whatever the form said."""
    assert _add(operator, "tiny", task="embed").status_code == 302
    assert ModelDeployment.objects.get(name="tiny").task == ModelDeployment.Task.EMBED
    ModelDeployment.objects.all().delete()
    (models_dir / "bert").mkdir()
    (models_dir / "bert" / "config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "model_type": "bert", "max_position_embeddings": 512})
    )
    assert _add(operator, "bert", task="generate").status_code == 302
    assert ModelDeployment.objects.get(name="tiny").task == ModelDeployment.Task.EMBED


def test_a_model_of_an_architecture_the_engine_does_not_serve_is_refused(operator, models_dir):
    (models_dir / "falcon").mkdir()
    (models_dir / "falcon" / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    response = _add(operator, str(models_dir / "falcon"))
    assert "is not supported (supported: LlamaForCausalLM" in response.content.decode()
    assert not ModelDeployment.objects.exists()


def test_a_directory_that_is_no_model_is_refused(operator, models_dir):
    (models_dir / "empty").mkdir()
    response = _add(operator, str(models_dir / "empty"))
    assert "No config.json" in response.content.decode()
    assert not ModelDeployment.objects.exists()


def test_revalidating_adapters_needs_the_change_permission(models_dir):
    deployment = ModelDeployment.objects.create(
        name="tiny", model_path=str(models_dir / "tiny"), max_model_len=256
    )
    tenant = tenant_create(name="A", slug="a", allowed_models=["tiny"])
    adapter = LoraAdapter.objects.create(
        tenant=tenant,
        name="tone",
        base_model=deployment,
        status="failed",
        version="v1",
        storage_path="/nowhere",
    )
    viewer = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_loraadapter"))
    client = Client()
    client.force_login(viewer)
    changelist = "/admin/inference/loraadapter/"

    page = client.get(changelist)
    attempt = client.post(changelist, {"action": "revalidate_selected", "_selected_action": [adapter.pk]})

    assert page.status_code == 200 and "revalidate_selected" not in page.content.decode()
    assert attempt.status_code in (200, 302)
    adapter.refresh_from_db()
    assert adapter.status == "failed"  # nothing was scheduled


@pytest.mark.parametrize(
    ("engine_settings", "error"),
    [
        ('{"warp_speed": 9}', "unknown engine setting &#x27;warp_speed&#x27;"),
        ('{"max_num_seqs": "lots"}', "max_num_seqs must be an integer"),
        ('{"kv_cache_memory": "a lot"}', "not a size"),
        ('{"enforce_eager": "yes"}', "enforce_eager must be true or false"),
    ],
)
def test_engine_settings_an_engine_would_refuse_are_refused_in_the_admin(
    operator, models_dir, engine_settings, error
):
    response = _add(operator, "tiny", engine_settings)

    assert response.status_code == 200  # the form again, with the error
    assert error in response.content.decode()
    assert not ModelDeployment.objects.exists()
    assert _add(operator, "tiny", '{"max_num_seqs": 16, "kv_cache_memory": "512MiB"}').status_code == 302
