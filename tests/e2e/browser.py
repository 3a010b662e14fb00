"""Helpers for browser tests: headless Chromium, and logging in. The servers they drive come from
tests.e2e.processes (web_server, engine_replica)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT_DIR = Path(os.environ.get("PAGODA_SCREENSHOT_DIR", tempfile.gettempdir())) / "pagoda-screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


@contextlib.contextmanager
def chromium(*, width: int = 1280, height: int = 900) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if CHROMIUM is None or CHROMEDRIVER is None:
        raise RuntimeError(
            "headless Chromium and chromedriver are required (apt-get install chromium chromium-driver)"
        )
    profile = tempfile.mkdtemp(prefix="pagoda-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(driver, name: str) -> Path:
    """Keep a picture of the page (for looking at layouts, and for failures)."""
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOT_DIR / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def log_in(driver, base_url: str, *, username: str, password: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(base_url + "/dashboard/login/")
    driver.find_element(By.ID, "id_username").send_keys(username)
    driver.find_element(By.ID, "id_password").send_keys(password)
    driver.find_element(By.ID, "login-submit").click()
    WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, "logout")))
