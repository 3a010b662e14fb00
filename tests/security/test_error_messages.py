"""API errors never carry the host's file paths, exception text or configuration."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from inference import tokenization
from inference.services.adapter_checks import AdapterInvalid, adapter_check

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_model_whose_tokenizer_cannot_load_is_a_503_without_its_path(world, tmp_path):
    hidden = tmp_path / "secret-host-dir" / "model"
    hidden.mkdir(parents=True)
    world.deployment.model_path = str(hidden)
    world.deployment.save()
    tokenization._load.cache_clear()
    body = {"model": world.model, "messages": [{"role": "user", "content": "Hi"}]}

    response = Client().post(
        "/v1/chat/completions", json.dumps(body), content_type="application/json", headers=world.headers()
    )

    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "model_unavailable"
    assert "secret-host-dir" not in response.content.decode() and "/" not in error["message"]


def test_an_adapter_against_an_unreadable_base_model_fails_without_the_path(adapters_dir, tmp_path):
    hidden = tmp_path / "secret-host-dir" / "model"
    hidden.mkdir(parents=True)

    with pytest.raises(AdapterInvalid) as failed:
        adapter_check(adapter_dir=adapters_dir["good"], model_path=str(hidden), base_name="tiny", max_rank=64)

    assert "secret-host-dir" not in str(failed.value)
    assert str(failed.value).startswith("The base model `tiny` cannot be read;")
