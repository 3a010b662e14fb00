"""The web process warms up as it starts (inference.services.warm): the enabled models' tokenizers
loaded and their chat templates compiled before /ready says ready, so that its first requests do
not wait seconds for transformers. The process itself is in tests/e2e/test_web_warm.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from django.test import Client

from core import warming
from inference import tokenization
from inference.models import ModelDeployment
from inference.services import warm
from inference.services.warm import models_warm, web_warm

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_tokenizers(monkeypatch):
    monkeypatch.setattr(warming, "_warming", False)  # put back after the test
    tokenization._load.cache_clear()
    tokenization._max_token_bytes.cache_clear()
    yield
    tokenization._load.cache_clear()
    tokenization._max_token_bytes.cache_clear()


def test_models_warm_loads_the_enabled_models_renders_their_chat_templates_and_bounds_their_tokens(
    smollm2_dir: Path, minilm_dir: Path, tmp_path: Path, monkeypatch
):
    ModelDeployment.objects.create(name="warm-a", model_path=str(smollm2_dir), max_model_len=512)
    # An embedding model: no chat template, and its requests still need the bound on a token's bytes.
    ModelDeployment.objects.create(name="warm-embed", model_path=str(minilm_dir), max_model_len=256)
    # Two deployments of one model directory: one load.
    ModelDeployment.objects.create(name="warm-b", model_path=str(smollm2_dir), max_model_len=1024)
    ModelDeployment.objects.create(
        name="warm-broken", model_path=str(tmp_path / "nothing"), max_model_len=512
    )
    ModelDeployment.objects.create(
        name="warm-disabled", model_path=str(tmp_path / "disabled"), max_model_len=512, enabled=False
    )
    rendered: list[str] = []
    real_render = warm.chat_prompt_ids
    monkeypatch.setattr(
        warm, "chat_prompt_ids", lambda path, messages: rendered.append(path) or real_render(path, messages)
    )

    assert models_warm() == 2

    assert tokenization._load.cache_info().currsize == 2
    assert tokenization._max_token_bytes.cache_info().currsize == 2  # read off tokenizer.json once
    # The broken one was tried and gave the request's error, which the warm-up let pass.
    assert sorted(rendered) == sorted([str(smollm2_dir), str(minilm_dir), str(tmp_path / "nothing")])
    hits = tokenization._load.cache_info().hits
    tokenization.chat_prompt_ids(str(smollm2_dir), [{"role": "user", "content": "Hi"}])
    assert tokenization._load.cache_info().hits == hits + 1  # the request found it loaded


def test_a_warming_web_process_is_live_and_not_ready_until_the_warm_up_ends(
    smollm2_dir: Path, operator_headers, caplog
):
    ModelDeployment.objects.create(name="warm-a", model_path=str(smollm2_dir), max_model_len=512)
    warming.mark_warming()

    live = Client().get("/live")
    during = Client(headers=operator_headers).get("/ready?scope=web")
    anonymous = Client().get("/ready?scope=web")
    with caplog.at_level(logging.INFO, logger="inference.services.warm"):
        web_warm()
    after = Client(headers=operator_headers).get("/ready?scope=web")

    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    assert (anonymous.status_code, anonymous.json()) == (503, {"status": "not_ready"})
    assert during.status_code == 503
    assert during.json()["checks"] == {
        "web": "warming: this process is loading the models' tokenizers",
        "database": "ok",
        "redis": "ok",
    }
    assert "web warm: 1 tokenizers loaded" in caplog.text
    assert (after.status_code, after.json()["status"]) == (200, "ready")


def test_a_failed_warm_up_still_ends_the_warming(monkeypatch, operator_headers, caplog):
    def database_away() -> list:
        raise ConnectionError("the database is away")

    monkeypatch.setattr(warm, "deployment_list_enabled", database_away)
    warming.mark_warming()

    with caplog.at_level(logging.INFO, logger="inference.services.warm"):
        web_warm()

    assert not warming.is_warming()
    assert "web warm-up failed" in caplog.text
    assert "web warm:" not in caplog.text
    assert Client(headers=operator_headers).get("/ready?scope=web").status_code == 200
