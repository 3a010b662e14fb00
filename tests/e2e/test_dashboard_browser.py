"""The dashboard in headless Chromium against a real daphne, PostgreSQL and Redis:
log in, create a key, see its secret once, then only its prefix, revoke it."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
from django.utils import timezone

from tenants.models import ApiKey
from tenants.selectors import quota_status
from tests.e2e.browser import chromium, log_in, screenshot
from tests.e2e.processes import web_server
from tests.helpers import PASSWORD, acme, usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _status_with_key(base_url: str, raw_key: str) -> int:
    request = urllib.request.Request(base_url + "/v1/usage", headers={"Authorization": f"Bearer {raw_key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _seed_usage(key: ApiKey) -> None:
    """A few ledger rows over the last days, so the usage charts have something to draw."""
    for days_ago, model, prompt, completion in [
        (0, "tiny-llama", 1200, 340),
        (1, "tiny-llama", 800, 410),
        (1, "tiny-qwen", 2400, 120),
        (3, "tiny-qwen", 600, 900),
        (6, "tiny-llama", 1500, 700),
    ]:
        usage_row(
            key,
            model=model,
            prompt=prompt,
            completion=completion,
            request_id=f"seed-{days_ago}-{model}",
            created_at=timezone.now() - timedelta(days=days_ago),
        )


@pytest.fixture
def world_options() -> dict:
    """Acme Research with limits and two models; its owner, olivia, works in the browser."""
    return {
        "tenant_a": acme(monthly_token_quota=100_000),
        "usernames": ("olivia", "adam", "mia", "otto"),
        "key_names": ("existing", "b-key"),
    }


def test_owner_creates_sees_secret_once_and_revokes_a_key_in_the_browser(tmp_path, world):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    tenant = world.tenant_a
    _seed_usage(world.key_a)

    with web_server(log_path=tmp_path / "daphne.log") as base_url, chromium() as driver:
        wait = WebDriverWait(driver, 20)
        log_in(driver, base_url, username=world.owner_a.username, password=PASSWORD)
        assert driver.current_url == f"{base_url}/dashboard/t/acme/"
        limits = {
            name: driver.find_element(By.CSS_SELECTOR, f"#{name} .stat-value").text
            for name in ("limit-rpm", "limit-tpm", "limit-concurrency", "active-keys")
        }
        assert limits == {
            "limit-rpm": "600",
            "limit-tpm": "90,000",
            "limit-concurrency": "8",
            "active-keys": "1",
        }
        # Seeded rows before the 1st of this month do not count against it.
        assert (
            driver.find_element(By.ID, "quota-remaining").text == f"{quota_status(tenant=tenant).remaining:,}"
        )
        screenshot(driver, "dashboard-overview")

        driver.find_element(By.ID, "nav-usage").click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#chart-daily svg g.bar")))
        assert len(driver.find_elements(By.CSS_SELECTOR, "#chart-models svg g.bar")) == 2
        screenshot(driver, "dashboard-usage")

        # Create: the secret is on the result page, and nowhere after it.
        driver.find_element(By.ID, "nav-keys").click()
        driver.find_element(By.ID, "id_name").send_keys("browser key")
        driver.find_element(By.ID, "create-key-submit").click()
        secret_input = wait.until(ec.presence_of_element_located((By.ID, "new-key-secret")))
        raw_key = secret_input.get_attribute("value")
        key = ApiKey.objects.get(tenant=tenant, name="browser key")
        assert re.fullmatch(rf"{key.display_prefix}_[A-Za-z0-9_-]{{43}}", raw_key)
        driver.find_element(By.ID, "copy-secret").click()
        wait.until(lambda d: d.find_element(By.ID, "copy-secret").text == "Copied")
        screenshot(driver, "dashboard-key-created")
        assert _status_with_key(base_url, raw_key) == 200

        driver.find_element(By.ID, "done").click()
        row = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f'tr[data-key-id="{key.pk}"]')))
        assert row.find_element(By.CLASS_NAME, "key-prefix").text == f"{key.display_prefix}…"
        assert row.find_element(By.CLASS_NAME, "key-status").text == "Active"
        assert raw_key not in driver.page_source
        assert raw_key.split("_", 1)[1] not in driver.page_source
        screenshot(driver, "dashboard-keys")

        # Revoke: a confirmation page, then a POST.
        row.find_element(By.CLASS_NAME, "revoke-link").click()
        wait.until(ec.element_to_be_clickable((By.ID, "confirm-revoke"))).click()
        row = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f'tr[data-key-id="{key.pk}"]')))
        assert row.find_element(By.CLASS_NAME, "key-status").text == "Revoked"
        assert row.find_elements(By.CLASS_NAME, "revoke-link") == []
        screenshot(driver, "dashboard-keys-revoked")

        key.refresh_from_db()
        assert key.revoked_at is not None
        assert _status_with_key(base_url, raw_key) == 401
