"""Project-level checks: layout, settings helpers, dependency directions, the compose file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from config.env import ImproperlyConfiguredEnv, database_from_url, envbool, envint

ROOT = Path(__file__).resolve().parent.parent


def test_no_top_level_package_shadows_the_standard_library():
    packages = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    assert packages, "expected top-level packages"
    shadowing = sorted(set(packages) & set(sys.stdlib_module_names))
    assert shadowing == []


def test_import_contracts_hold():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


def test_envbool_rejects_malformed_values(monkeypatch):
    monkeypatch.setenv("PAGODA_FLAG", "maybe")
    with pytest.raises(ImproperlyConfiguredEnv, match="PAGODA_FLAG"):
        envbool("PAGODA_FLAG", False)
    monkeypatch.setenv("PAGODA_FLAG", "yes")
    assert envbool("PAGODA_FLAG", False) is True


def test_envint_rejects_non_integers_and_values_below_minimum(monkeypatch):
    monkeypatch.setenv("PAGODA_N", "12x")
    with pytest.raises(ImproperlyConfiguredEnv, match="not an integer"):
        envint("PAGODA_N", 1)
    monkeypatch.setenv("PAGODA_N", "0")
    with pytest.raises(ImproperlyConfiguredEnv, match="below the minimum"):
        envint("PAGODA_N", 1, minimum=1)


def test_env_value_can_come_from_a_file(monkeypatch, tmp_path):
    secret = tmp_path / "n"
    secret.write_text("42\n")
    monkeypatch.delenv("PAGODA_N", raising=False)
    monkeypatch.setenv("PAGODA_N_FILE", str(secret))
    assert envint("PAGODA_N", 1) == 42


def test_database_url_parses_postgres_and_rejects_unknown_schemes():
    db = database_from_url("postgres://u:p%40ss@db.example:5433/pagoda?sslmode=require")
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == (
        "pagoda", "u", "p@ss", "db.example", "5433",
    )
    assert db["OPTIONS"] == {"sslmode": "require"}
    with pytest.raises(ImproperlyConfiguredEnv, match="not supported"):
        database_from_url("mysql://u@h/db")
    with pytest.raises(ImproperlyConfiguredEnv, match="names no database"):
        database_from_url("postgres://u@h:5432/")


def _settings_import(env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "REDIS_URL": "redis://127.0.0.1:6379/0"}
    return subprocess.run(
        [sys.executable, "-c", "import config.settings"],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_production_refuses_the_development_secret_key():
    result = _settings_import({"DEBUG": "false"})
    assert result.returncode != 0
    assert "SECRET_KEY is the development default" in result.stderr


def test_production_starts_with_real_secrets():
    result = _settings_import(
        {"DEBUG": "false", "SECRET_KEY": "x" * 50, "API_KEY_PEPPER": "y" * 32}
    )
    assert result.returncode == 0, result.stderr


def test_malformed_debug_value_stops_start_up():
    result = _settings_import({"DEBUG": "sometimes"})
    assert result.returncode != 0
    assert "DEBUG='sometimes' is not a boolean" in result.stderr
