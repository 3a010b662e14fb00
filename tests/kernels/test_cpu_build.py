"""The C kernel cache loads only libraries this user built, from a directory no one else can write."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from kernels import _cpu_build

COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler on this machine")

PROBE = "int probe(void) { return 42; }\n"
# What an attacker would plant: its constructor runs on load, leaving a mark, and probe lies.
PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void mark(void) {
    FILE *f = fopen("%s", "w");
    if (f) fclose(f);
}
int probe(void) { return 666; }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache root the build is pointed at, a one-function source, and a fresh table of loads."""
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "probe.c").write_text(PROBE)
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(root))
    monkeypatch.delenv("PAGODA_CPU_KERNELS", raising=False)
    monkeypatch.setattr(_cpu_build, "SOURCES", sources)
    monkeypatch.setattr(_cpu_build, "_loaded", {})
    return root / "kernels"


def _load() -> ctypes.CDLL | None:
    _cpu_build._loaded.clear()
    return _cpu_build.load("probe", {"probe": (ctypes.c_int, [])})


def _plant(tmp_path: Path, target: Path) -> Path:
    """A library whose loading leaves a mark file, compiled to ``target``; returns the mark's path."""
    mark = tmp_path / "planted-library-was-loaded"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED % mark)
    subprocess.run([COMPILER, "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    return mark


def _cached_library(directory: Path) -> Path:
    (library,) = directory.glob("probe-*.so")
    return library


def _build_unloaded(directory: Path) -> Path:
    """The cached library built but not loaded: dlopen hands back a library already loaded from
    the same path, so a planted one is only ever run when its path is new to this process."""
    directory.mkdir(mode=0o700, parents=True)
    return _cpu_build._build("probe", COMPILER, directory, _cpu_build.flags())


def test_a_new_cache_directory_is_private_and_its_library_is_built_once(cache):
    lib = _load()

    assert lib is not None and lib.probe() == 42
    library = _cached_library(cache)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert [p.name for p in cache.iterdir()] == [library.name]  # no build leftovers
    built = library.stat().st_mtime_ns
    assert _load().probe() == 42
    assert library.stat().st_mtime_ns == built  # the trusted copy is loaded, not rebuilt


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777])
def test_a_library_planted_in_a_cache_others_can_write_is_never_loaded(cache, tmp_path, mode):
    library = _build_unloaded(cache)
    mark = _plant(tmp_path, library)
    cache.chmod(mode)

    lib = _load()

    assert not mark.exists()
    assert lib is not None and lib.probe() == 42  # built afresh, privately


def test_a_cache_directory_of_another_user_is_not_used(cache, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    library = _build_unloaded(cache)
    mark = _plant(tmp_path, library)
    os.chown(cache, 65534, 65534)

    lib = _load()

    assert not mark.exists()
    assert lib is not None and lib.probe() == 42


def test_a_cache_below_a_directory_others_can_write_is_not_used(cache, tmp_path):
    mark = _plant(tmp_path, _build_unloaded(cache))
    cache.parent.chmod(0o777)  # not sticky: anyone could swap the kernels directory for their own

    lib = _load()

    assert not mark.exists()
    assert lib is not None and lib.probe() == 42


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_cached_library_others_can_write_is_rebuilt_not_loaded(cache, tmp_path, mode):
    library = _build_unloaded(cache)
    mark = _plant(tmp_path, library)
    library.chmod(mode)

    lib = _load()

    assert not mark.exists()
    assert lib is not None and lib.probe() == 42
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)  # rebuilt over, privately


def test_a_cached_library_of_another_user_is_rebuilt_not_loaded(cache, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    library = _build_unloaded(cache)
    mark = _plant(tmp_path, library)
    os.chown(library, 65534, 65534)

    lib = _load()

    assert not mark.exists()
    assert lib is not None and lib.probe() == 42
    assert library.stat().st_uid == os.geteuid()


def test_a_symlink_in_place_of_the_cached_library_is_not_followed(cache, tmp_path):
    library = _build_unloaded(cache)
    elsewhere = tmp_path / "elsewhere.so"
    mark = _plant(tmp_path, elsewhere)
    library.unlink()
    library.symlink_to(elsewhere)

    lib = _load()

    assert not mark.exists()
    assert lib is not None and lib.probe() == 42


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "riscv64", "ppc64le"])
def test_other_machines_get_no_x86_flags(machine):
    # An x86-only flag fails an ARM compiler, and a failed build sends the machine to torch.
    built = _cpu_build.flags(machine)
    assert not {"-march=native", "-mprefer-vector-width=512", "-mno-avx512f"} & set(built)
    assert built[: len(_cpu_build.BASE_FLAGS)] == _cpu_build.BASE_FLAGS
    assert _cpu_build.flags(machine, portable_build=True) == built
    assert ("-mcpu=native" in built) == (machine in ("aarch64", "arm64"))


def test_x86_builds_for_its_own_vector_units_and_the_portable_build_without_avx512():
    assert {"-march=native", "-mprefer-vector-width=512"} <= set(_cpu_build.flags("x86_64"))
    assert "-mno-avx512f" not in _cpu_build.flags("x86_64")
    assert _cpu_build.flags("x86_64", portable_build=True)[-1] == "-mno-avx512f"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the portable build differs on x86 only")
def test_the_portable_build_compiles_without_avx512_and_is_kept_apart(cache, monkeypatch):
    (_cpu_build.SOURCES / "probe.c").write_text(
        "#ifdef __AVX512F__\nint probe(void) { return 512; }\n#else\nint probe(void) { return 42; }\n#endif\n"
    )
    monkeypatch.setenv("PAGODA_CPU_PORTABLE", "1")
    portable = _cpu_build.load("probe", {"probe": (ctypes.c_int, [])})
    monkeypatch.setenv("PAGODA_CPU_PORTABLE", "0")
    native = _cpu_build.load("probe", {"probe": (ctypes.c_int, [])})

    assert portable is not None and portable.probe() == 42
    assert native is not None and native is not portable
    has_avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    assert native.probe() == (512 if has_avx512 else 42)
    assert len(list(cache.glob("probe-*.so"))) == 2
