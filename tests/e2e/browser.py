"""Helpers for browser tests: a real daphne serving the test database, and headless Chromium.

The daphne subprocess reads pytest-django's test database, so tests using it must be
`@pytest.mark.django_db(transaction=True)`: rows are committed and visible to the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from django.conf import settings
from django.db import connection

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT_DIR = Path(os.environ.get("PAGODA_SCREENSHOT_DIR", tempfile.gettempdir())) / "pagoda-screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_url_for_tests() -> str:
    """A DATABASE_URL for the database this test process is using (pytest-django's test one)."""
    db = connection.settings_dict
    if db["ENGINE"] != "django.db.backends.postgresql":
        raise RuntimeError("browser tests need PostgreSQL (another process must reach the database)")
    auth = quote(db["USER"] or "", safe="")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"], safe="")
    host = db["HOST"] or "localhost"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{auth}{'@' if auth else ''}{host}{port}/{quote(db['NAME'], safe='')}"


# What the e2e tests read /ready's details (and /metrics) with, from the servers they start.
E2E_METRICS_TOKEN = "e2e-metrics-token"


def server_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PAGODA_METRICS_TOKEN=E2E_METRICS_TOKEN,
        DJANGO_SETTINGS_MODULE="config.settings",
        DATABASE_URL=database_url_for_tests(),
        REDIS_URL=settings.REDIS_URL,
        PAGODA_REDIS_PREFIX=settings.REDIS_PREFIX,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def wait_for_http(url: str, *, timeout: float, process: subprocess.Popen | None = None) -> None:
    def answers() -> bool:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    wait_until(answers, timeout=timeout, interval=0.2, what=f"{url} to answer")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def daphne_server(*, log_path: Path, timeout: float = 90.0) -> Iterator[str]:
    """Serve config.asgi with daphne on a free port; yields the base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"],
            cwd=ROOT,
            env=server_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            try:
                wait_for_http(base_url + "/health", timeout=timeout, process=process)
            except Exception as exc:
                raise RuntimeError(
                    f"{exc}\n--- daphne log ---\n{log_path.read_text(errors='replace')}"
                ) from exc
            yield base_url
        finally:
            _stop(process)


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


@contextlib.contextmanager
def engine_worker(*, model: str, log_path: Path, timeout: float = 180.0) -> Iterator[subprocess.Popen]:
    """One engine replica for a ModelDeployment row (`manage.py run_engine`), ready once its
    heartbeat is live."""
    from inference.gateway.replicas import live_replica_ids

    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "run_engine", "--model", model],
            cwd=ROOT,
            env=server_env(OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:

            def live() -> bool:
                if process.poll() is not None:
                    raise AssertionError(f"the engine exited with {process.returncode}")
                return bool(live_replica_ids(model))

            try:
                wait_until(live, timeout=timeout, interval=0.25, what=f"the engine of {model} to be live")
            except AssertionError as exc:
                raise RuntimeError(
                    f"engine for {model} is not live ({exc})\n--- engine log ---\n"
                    + log_path.read_text(errors="replace")
                ) from None
            yield process
        finally:
            _stop(process)
