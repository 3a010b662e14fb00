"""The playground in headless Chromium: a real daphne, a real engine worker on a tiny random
model, PostgreSQL and Redis; tokens arrive over the websocket and appear as they come."""

from __future__ import annotations

import pytest

from tenants.models import UsageRecord
from tests.e2e.browser import chromium, log_in, screenshot
from tests.e2e.processes import engine_replica, web_server
from tests.helpers import PASSWORD

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-chat"

# Records every text the assistant bubble shows, so the test can see the reply grow token by token.
RECORD_BUBBLE_TEXTS = """
window.__bubbleTexts = [];
window.__bubbleTimes = [];
new MutationObserver(function () {
  var bubbles = document.querySelectorAll("#pg-transcript .msg-assistant");
  if (!bubbles.length) return;
  var text = bubbles[bubbles.length - 1].textContent;
  var seen = window.__bubbleTexts;
  if (text && seen[seen.length - 1] !== text) { seen.push(text); window.__bubbleTimes.push(performance.now()); }
}).observe(document.getElementById("pg-transcript"), {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("playground-model"), arch="llama", size="tiny", seed=0)


@pytest.fixture
def world_options(tiny_model_dir) -> dict:
    """The world with the served tiny model; A's member, mia, tries it in the playground."""
    return {
        "model": MODEL,
        "model_dir": tiny_model_dir,
        "deployment": {
            "max_model_len": 256,
            "engine_settings": {"device": "cpu", "num_blocks": 64, "max_num_seqs": 4},
        },
        "tenant_a": {"name": "Acme Research", "slug": "acme"},
        "usernames": ("olivia", "adam", "mia", "otto"),
        "key_names": ("playground", "b-key"),
    }


def test_playground_streams_a_reply_token_by_token(tmp_path, world):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    key, raw_key = world.key_a, world.raw_key_a

    with (
        engine_replica(model=MODEL, log_path=tmp_path / "engine.log"),
        web_server(log_path=tmp_path / "daphne.log") as base_url,
        chromium() as driver,
    ):
        wait = WebDriverWait(driver, 60)
        log_in(driver, base_url, username=world.member_a.username, password=PASSWORD)
        driver.find_element(By.ID, "nav-playground").click()
        wait.until(ec.presence_of_element_located((By.ID, "pg-input")))
        assert [o.text for o in driver.find_elements(By.CSS_SELECTOR, "#pg-model option")] == [MODEL]
        driver.execute_script(RECORD_BUBBLE_TEXTS)

        driver.find_element(By.ID, "pg-key").send_keys(raw_key)
        max_tokens = driver.find_element(By.ID, "pg-max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("24")
        driver.find_element(By.ID, "pg-input").send_keys("Tell me about pagodas.")
        driver.find_element(By.ID, "pg-send").click()

        meta = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#pg-transcript .msg-meta")))
        screenshot(driver, "dashboard-playground")
        reply = driver.find_element(By.CSS_SELECTOR, "#pg-transcript .msg-assistant").text
        texts = driver.execute_script("return window.__bubbleTexts;")
        print("TIMES", driver.execute_script("return window.__bubbleTimes;"))

        assert driver.find_elements(By.ID, "pg-last-error") == []
        assert reply.strip() != ""
        # Several deltas, each extending the one before: the reply streamed in, it did not land whole.
        assert len(texts) >= 2
        assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
        assert texts[-1] == driver.execute_script(
            "var b = document.querySelectorAll('#pg-transcript .msg-assistant'); return b[b.length-1].textContent;"
        )
        meta_text = meta.text
        assert meta_text.endswith(("length", "stop"))
        assert driver.find_element(By.ID, "pg-send").is_enabled()
        assert not driver.find_element(By.ID, "pg-cancel").is_enabled()

    record = UsageRecord.objects.get(api_key=key)
    assert record.model == MODEL
    assert 0 < record.completion_tokens <= 24
    # The usage the page shows is what the ledger billed.
    assert f"{record.prompt_tokens} prompt + {record.completion_tokens} completion tokens" in meta_text
