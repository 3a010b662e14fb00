"""A worker on the `batches` queue loads the enabled models' tokenizers when it is ready, not on
its first batch's lines (which would wait seconds for transformers beside a busy replica); the
worker process itself is in tests/e2e/test_batch_serving.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from batches.runner import runner_warm
from inference import tokenization
from inference.models import ModelDeployment

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_tokenizers():
    tokenization._load.cache_clear()
    yield
    tokenization._load.cache_clear()


def _cached(path: str) -> bool:
    hits = tokenization._load.cache_info().hits
    tokenization._load(path)  # a hit when it is loaded; a load (and a miss) otherwise
    return tokenization._load.cache_info().hits > hits


def test_the_warm_up_loads_every_enabled_models_tokenizer_and_survives_a_broken_one(
    smollm2_dir: Path, tmp_path: Path, caplog
):
    ModelDeployment.objects.create(name="warm-enabled", model_path=str(smollm2_dir), max_model_len=512)
    ModelDeployment.objects.create(
        name="warm-broken", model_path=str(tmp_path / "nothing-here"), max_model_len=512
    )
    ModelDeployment.objects.create(
        name="warm-disabled", model_path=str(tmp_path / "disabled"), max_model_len=512, enabled=False
    )
    with caplog.at_level(logging.INFO, logger="batches.runner"):
        runner_warm()
    assert "batch runner warm: 1 tokenizers loaded" in caplog.text
    assert tokenization._load.cache_info().currsize == 1
    assert _cached(str(smollm2_dir))
