"""The memory allocator of an engine process on CPU: tcmalloc when the machine has it.

A CPU forward allocates and frees activations of megabytes to tens of megabytes per layer. glibc's
malloc hands chunks that size back to the kernel on free and takes them again with fresh page
faults on the next allocation: on SmolLM2 a 2,048-token prefill step took 4.2 s under glibc and
2.1 s under tcmalloc, which keeps freed memory for reuse (vLLM's CPU backend asks for the same
preload). The allocator can only be chosen before the process starts, so an engine process that
was started without it replaces itself with a copy that has it (``reexec_with_tcmalloc``), and
launchers put it in the child's environment (``with_tcmalloc``).

PAGODA_TCMALLOC=0 keeps glibc's malloc; PAGODA_TCMALLOC=/path/to/libtcmalloc.so picks a library.
Debian and Ubuntu ship it as libtcmalloc-minimal4.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def tcmalloc_path() -> str | None:
    """The tcmalloc library to preload, or None (none installed, or PAGODA_TCMALLOC=0)."""
    choice = os.environ.get("PAGODA_TCMALLOC", "1")
    if choice == "0":
        return None
    if choice not in ("", "1"):
        return choice if Path(choice).is_file() else None
    for path in _CANDIDATES:
        if Path(path).is_file():
            return path
    found = ctypes.util.find_library("tcmalloc_minimal")
    if found:
        matches = glob.glob(f"/usr/lib*/**/{found}", recursive=True)
        return matches[0] if matches else None
    return None


def with_tcmalloc(env: dict[str, str]) -> dict[str, str]:
    """``env`` with tcmalloc first in LD_PRELOAD (unchanged when there is none to preload)."""
    path = tcmalloc_path()
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if path is None or any("tcmalloc" in Path(p).name for p in preload):
        return env
    return {**env, "LD_PRELOAD": ":".join([path, *preload])}


def tcmalloc_loaded() -> bool:
    try:
        return "tcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def reexec_with_tcmalloc(argv: Sequence[str]) -> None:
    """Replace this process with ``argv`` run under tcmalloc, when tcmalloc is installed and not
    loaded yet; returns (doing nothing) otherwise. Call it before any work is done."""
    if os.environ.get("_PAGODA_REEXECED") or tcmalloc_loaded():
        return
    env = with_tcmalloc(dict(os.environ))
    if "LD_PRELOAD" not in env or env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return
    env["_PAGODA_REEXECED"] = "1"  # never loop, whatever the loader made of the preload
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)
