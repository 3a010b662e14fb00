"""Compile-on-first-use for the C kernels of the CPU path (kernels/cpu/*.c), loaded through ctypes.

Each source is compiled with the machine's C compiler for the machine's own vector units, once, into
PAGODA_CACHE_DIR/kernels under a name keyed by the source, the flags, the compiler and the CPU;
later processes load the cached library. torch is imported first, so a library's libgomp.so.1
resolves to torch's own OpenMP runtime and shares its threads. Where no compiler exists, or
PAGODA_CPU_KERNELS=0, `load` returns None and callers keep to their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401  (loaded before any library: see the docstring)

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("cpu")
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))
    return root / "kernels"


def _cpu_signature() -> str:
    # -march=native builds for this CPU: a cache shared with machines of another kind must not
    # hand them this build, so the key holds the CPU's model and flags.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join([ln for ln in lines if ln.startswith(("model name", "flags"))][:2])
    except OSError:
        return platform.processor()


def _build(name: str, compiler: str) -> Path:
    source = SOURCES / f"{name}.c"
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes()
        + headers
        + " ".join(FLAGS).encode()
        + compiler.encode()
        + _cpu_signature().encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and moved into place: processes compiling at once never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(source), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(name: str, signatures: dict[str, tuple[object, list[object]]]) -> ctypes.CDLL | None:
    """kernels/cpu/<name>.c compiled and loaded with its functions' (restype, argtypes) set, or
    None where it cannot be (the reason is logged once)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        _loaded[name] = None
        if os.environ.get("PAGODA_CPU_KERNELS", "1") == "0":
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.warning("no C compiler found: the CPU path runs without its C kernels")
            return None
        try:
            lib = ctypes.CDLL(str(_build(name, compiler)))
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning(
                "CPU kernel %s unavailable (%s): its torch path runs instead",
                name,
                getattr(exc, "stderr", "") or exc,
            )
            return None
        for fn_name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, fn_name)
            fn.restype = restype
            fn.argtypes = argtypes
        _loaded[name] = lib
        return lib
