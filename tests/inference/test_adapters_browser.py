"""The adapters page in headless Chromium against a real daphne, a real Celery worker, PostgreSQL
and Redis: an owner uploads a PEFT adapter, the worker validates it, the page shows it ready; a
second upload fails with its reason on the page; the API then lists the ready one."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.models import LoraAdapter
from tests.e2e.browser import chromium, log_in, screenshot
from tests.e2e.processes import ROOT, server_env, web_server
from tests.helpers import PASSWORD
from tests.inference.peft_adapters import CONFIG, WEIGHTS

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@contextlib.contextmanager
def celery_worker(*, log_path: Path) -> Iterator[subprocess.Popen]:
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "--pool=solo",
                "--loglevel=info",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=ROOT,
            env=server_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@pytest.mark.world(tenant_a={"name": "Acme Research", "slug": "acme"}, key_names=("prod", "b-key"))
def test_owner_uploads_an_adapter_that_a_worker_validates(
    tmp_path, monkeypatch, settings, world, adapters_dir
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    media = tmp_path / "media"
    # The server and the worker (other processes) store and read adapters here.
    monkeypatch.setenv("PAGODA_MEDIA_DIR", str(media))
    settings.MEDIA_ROOT = media
    deployment, raw_key = world.deployment, world.raw_key_a

    with (
        celery_worker(log_path=tmp_path / "celery.log"),
        web_server(log_path=tmp_path / "daphne.log") as base_url,
        chromium() as driver,
    ):
        wait = WebDriverWait(driver, 90)
        log_in(driver, base_url, username=world.owner_a.username, password=PASSWORD)

        for name, source in (("support-tone", "good"), ("too-big-rank", "rank-128")):
            driver.find_element(By.ID, "nav-adapters").click()
            wait.until(ec.presence_of_element_located((By.ID, "upload-adapter-submit")))
            driver.find_element(By.ID, "id_name").send_keys(name)
            Select(driver.find_element(By.ID, "id_base_model")).select_by_value(deployment.name)
            paths = [str(adapters_dir[source] / CONFIG), str(adapters_dir[source] / WEIGHTS)]
            driver.find_element(By.ID, "id_files").send_keys("\n".join(paths))
            driver.find_element(By.ID, "upload-adapter-submit").click()
            wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f'tr[data-adapter="{name}"]')))

        # The page reloads itself while a validation is pending.
        def status_of(name: str) -> str:
            row = driver.find_element(By.CSS_SELECTOR, f'tr[data-adapter="{name}"]')
            return row.find_element(By.CLASS_NAME, "adapter-status").text

        try:
            wait.until(
                lambda d: status_of("support-tone") == "Ready" and status_of("too-big-rank") == "Failed"
            )
        except Exception as exc:
            raise AssertionError((tmp_path / "celery.log").read_text(errors="replace")[-4000:]) from exc
        failed = driver.find_element(By.CSS_SELECTOR, 'tr[data-adapter="too-big-rank"] .adapter-reason')
        assert failed.text == (
            "The adapter's rank r=128 is above the maximum rank 64 this base model serves. "
            "Train the adapter again with r <= 64."
        )
        screenshot(driver, "dashboard-adapters")

        ready = LoraAdapter.objects.get(name="support-tone")
        assert Path(ready.storage_path).parent == media / "adapters" / "acme" / "support-tone"
        request = urllib.request.Request(
            base_url + "/v1/models", headers={"Authorization": f"Bearer {raw_key}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            models = json.loads(response.read())["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [
            (deployment.name, None),
            ("support-tone", deployment.name),
        ]
