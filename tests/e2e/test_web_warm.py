"""The web entry point (`python -m config.web_server`) warms up as it starts: /ready?scope=web says
not ready until the enabled models' tokenizers are loaded, and the log says how long it took."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from inference.models import ModelDeployment
from tests.e2e.processes import E2E_METRICS_TOKEN, start_web
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]


def _ready_web(base_url: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        base_url + "/ready?scope=web", headers={"Authorization": f"Bearer {E2E_METRICS_TOKEN}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def deployment(committed_db, smollm2_dir: Path) -> str:
    # Outside the test's transaction: the web process must see it.
    with committed_db():
        ModelDeployment.objects.create(name="e2e-warm", model_path=str(smollm2_dir), max_model_len=512)
    return "e2e-warm"


def test_the_web_process_is_ready_only_once_it_loaded_the_models_tokenizers(deployment: str, tmp_path: Path):
    log_path = tmp_path / "web.log"
    web, base_url = start_web(log_path=log_path)
    answers: list[tuple[int, str, bool]] = []
    try:

        def ready() -> bool:
            status, body = _ready_web(base_url)
            # Whether the warm-up's line was in the log when this answer came.
            logged = "web warm: " in log_path.read_text(errors="replace")
            answers.append((status, body["checks"]["web"], logged))
            return status == 200

        wait_until(ready, timeout=180, interval=0.05, what="the web process to be ready")
    finally:
        web.stop()
    log = log_path.read_text(errors="replace")
    assert re.search(r"web warm: 1 tokenizers loaded in \d+\.\d s", log), log[-3000:]
    # Not one answer said ready before the tokenizers were loaded; every earlier one said warming.
    assert answers[-1] == (200, "ok", True)
    assert all(check.startswith("warming") for status, check, _ in answers[:-1] if status == 503), answers
