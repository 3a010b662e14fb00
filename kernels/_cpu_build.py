"""Compile-on-first-use for the C kernels of the CPU path (kernels/cpu/*.c), loaded through ctypes.

Each source is compiled with the machine's C compiler for the machine's own vector units, once, into
PAGODA_CACHE_DIR/kernels under a name keyed by the source, the flags, the compiler and the CPU;
later processes load the cached library. The vector flags are the machine's own: x86-64 builds for
its native ISA and prefers 512-bit vectors (the AVX-512 paths), ARM builds with -mcpu=native, other
machines with -O3 alone. PAGODA_CPU_PORTABLE=1 builds x86 without AVX-512, so the portable code
paths run (and are tested) on any machine. Loading a library runs its code, and the cache path is
predictable, so a library is loaded only from a directory this user owns that no one else can
write (nor rename: every directory above it is this user's or root's, and writable by others only
when sticky), and only when the file itself is this user's and writable by no one else. Where the
cache fails that test the library is built afresh in a private temporary directory instead, and a
cached file that fails it is rebuilt over. torch is imported before an OpenMP library is loaded,
so its libgomp.so.1 resolves to torch's own OpenMP runtime and shares its threads; a library built
without OpenMP (`openmp=False`: spin_wait, which an engine process reads before it starts torch)
imports nothing. Where no compiler exists, or PAGODA_CPU_KERNELS=0, `load` returns None and callers
keep to their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("cpu")
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# Vector flags by platform.machine(): the x86-only ones given to an ARM compiler fail the build,
# which would send the machine silently to the torch paths.
_VECTOR_FLAGS = {
    "x86_64": ("-march=native", "-mprefer-vector-width=512"),
    "amd64": ("-march=native", "-mprefer-vector-width=512"),
    "aarch64": ("-mcpu=native",),
    "arm64": ("-mcpu=native",),
}
_PORTABLE_FLAGS = {"x86_64": ("-mno-avx512f",), "amd64": ("-mno-avx512f",)}


def portable() -> bool:
    """Whether PAGODA_CPU_PORTABLE=1 asks for the builds without AVX-512."""
    return os.environ.get("PAGODA_CPU_PORTABLE", "0") == "1"


def flags(
    machine: str | None = None, *, portable_build: bool = False, openmp: bool = True
) -> tuple[str, ...]:
    """The compiler flags for ``machine`` (this one by default)."""
    arch = (machine or platform.machine()).lower()
    extra = _PORTABLE_FLAGS.get(arch, ()) if portable_build else ()
    base = BASE_FLAGS if openmp else tuple(f for f in BASE_FLAGS if f != "-fopenmp")
    return base + _VECTOR_FLAGS.get(arch, ()) + extra


_lock = threading.Lock()
_loaded: dict[tuple[str, bool], ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))
    return root / "kernels"


class UnsafeCacheError(OSError):
    """A library or its directory that someone other than this user (or root) could have written."""


def _check_private(st: os.stat_result, what: str, *, kind: int) -> None:
    if stat.S_IFMT(st.st_mode) != kind:
        raise UnsafeCacheError(f"{what} is not a plain {'directory' if kind == stat.S_IFDIR else 'file'}")
    if st.st_uid != os.geteuid():
        raise UnsafeCacheError(f"{what} belongs to uid {st.st_uid}, not this user ({os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(
            f"{what} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
        )


def _check_ancestors(directory: Path) -> None:
    # Whoever may write a directory above the cache may rename the cache away and put their own in
    # its place; a sticky directory (/tmp) lets each user rename only their own entries.
    for parent in directory.parents:
        st = os.stat(parent)
        if st.st_uid not in (0, os.geteuid()):
            raise UnsafeCacheError(f"{parent} above the kernel cache belongs to uid {st.st_uid}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise UnsafeCacheError(f"{parent} above the kernel cache is writable by others and not sticky")


def _private_dir(directory: Path) -> Path:
    """``directory`` (made 0o700 where it is missing), checked to be this user's alone."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    # Resolved once, and that path used from here on: no symlink on it can be swapped later.
    directory = directory.resolve()
    _check_private(os.lstat(directory), str(directory), kind=stat.S_IFDIR)
    _check_ancestors(directory)
    return directory


def _trusted(library: Path) -> bool:
    """Whether ``library`` is a plain file of this user's that no one else can write (False when
    it is missing; raises nothing for a bad one, which the caller rebuilds over)."""
    try:
        _check_private(os.lstat(library), str(library), kind=stat.S_IFREG)
    except FileNotFoundError:
        return False
    except UnsafeCacheError as exc:
        log.warning("not loading the cached CPU kernel: %s; rebuilding it", exc)
        return False
    return True


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return next(
        (frozenset(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), frozenset()
    )


def _cpu_signature() -> str:
    # -march=native builds for this CPU: a cache shared with machines of another kind must not
    # hand them this build, so the key holds the CPU's model and flags.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join([ln for ln in lines if ln.startswith(("model name", "flags"))][:2])
    except OSError:
        return platform.processor()


def _build(name: str, compiler: str, directory: Path, build_flags: tuple[str, ...]) -> Path:
    """The library for kernels/cpu/<name>.c in ``directory`` (a private one), compiled unless a
    trusted build of the same key is there already."""
    source = SOURCES / f"{name}.c"
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes()
        + headers
        + " ".join(build_flags).encode()
        + compiler.encode()
        + _cpu_signature().encode()
    ).hexdigest()[:16]
    out = directory / f"{name}-{key}.so"
    if _trusted(out):
        return out
    # Built beside its final name and moved into place: processes compiling at once never load a
    # half-written library. The linker creates its output with the process's umask, so the build
    # happens in a directory of its own (0o700) that no one else can reach until it is made private.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as build:
        tmp = os.path.join(build, out.name)
        subprocess.run(
            [compiler, *build_flags, "-o", tmp, str(source), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.chmod(tmp, 0o700)
        os.replace(tmp, out)
    return out


def load(
    name: str, signatures: Mapping[str, tuple[Any, Sequence[Any]]], *, openmp: bool = True
) -> ctypes.CDLL | None:
    """kernels/cpu/<name>.c compiled and loaded with its functions' (restype, argtypes) set, or
    None where it cannot be (the reason is logged once). The portable build (PAGODA_CPU_PORTABLE=1)
    is kept apart from the native one. ``openmp=False``: built without OpenMP, and torch is not
    imported for it."""
    if openmp:
        import torch  # noqa: F401  (before the library: its libgomp.so.1 is then torch's)
    key = (name, portable())
    with _lock:
        if key in _loaded:
            return _loaded[key]
        _loaded[key] = None
        if os.environ.get("PAGODA_CPU_KERNELS", "1") == "0":
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.warning("no C compiler found: the CPU path runs without its C kernels")
            return None
        try:
            lib = _build_and_load(name, compiler, flags(portable_build=key[1], openmp=openmp))
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
        _loaded[key] = lib
        return lib


def _build_and_load(name: str, compiler: str, build_flags: tuple[str, ...]) -> ctypes.CDLL:
    try:
        directory = _private_dir(_cache_dir())
    except UnsafeCacheError as exc:
        # Never the shared cache: a build of this process's own, in a directory only it knows.
        log.warning("kernel cache refused (%s): building %s in a private temporary directory", exc, name)
        with tempfile.TemporaryDirectory(prefix="pagoda-kernels-") as tmp:
            # The mapping outlives the file: the directory goes once the library is loaded.
            return ctypes.CDLL(str(_build(name, compiler, _private_dir(Path(tmp)), build_flags)))
    return ctypes.CDLL(str(_build(name, compiler, directory, build_flags)))
