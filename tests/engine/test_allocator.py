"""Engine processes run under tcmalloc where the machine has it, with OpenMP threads that sleep soon
after their work (engine.allocator)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.allocator import ENGINE_OMP_SPINCOUNT, tcmalloc_path, with_omp_spincount, with_tcmalloc

ROOT = Path(__file__).resolve().parents[2]
needs_tcmalloc = pytest.mark.skipif(tcmalloc_path() is None, reason="libtcmalloc-minimal4 is not installed")

# A process that asks for tcmalloc the way `python -m engine serve` does, then says what it runs on.
_PROBE = """
import os
from engine.allocator import reexec_as_engine_process, tcmalloc_loaded
reexec_as_engine_process([__file__])
print("loaded" if tcmalloc_loaded() else "not loaded")
print(os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


def _run_probe(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "probe.py"
    path.write_text(_PROBE)
    return subprocess.run(
        [sys.executable, str(path)],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_tcmalloc
def test_a_launcher_puts_tcmalloc_first_in_the_preload():
    env = with_tcmalloc({"LD_PRELOAD": "/lib/other.so"})
    assert env["LD_PRELOAD"] == f"{tcmalloc_path()}:/lib/other.so"
    assert with_tcmalloc(env) == env  # never twice


def test_pagoda_tcmalloc_0_keeps_the_environment_as_it_is(monkeypatch):
    monkeypatch.setenv("PAGODA_TCMALLOC", "0")
    assert with_tcmalloc({"PATH": "/bin"}) == {"PATH": "/bin"}


@needs_tcmalloc
def test_an_engine_process_started_without_tcmalloc_replaces_itself_with_one_that_has_it(tmp_path):
    out = _run_probe(tmp_path)

    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "loaded"


def test_an_engine_process_keeps_glibc_malloc_when_told_to(tmp_path):
    out = _run_probe(tmp_path, PAGODA_TCMALLOC="0")

    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "not loaded"


def test_an_engine_process_runs_with_the_short_openmp_spin_unless_its_environment_sets_one(tmp_path):
    # Without tcmalloc too: the spin count alone is worth the re-exec (OpenMP reads it when it loads).
    out = _run_probe(tmp_path, PAGODA_TCMALLOC="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[1] == f"{ENGINE_OMP_SPINCOUNT} None"
    for env, want in (
        ({"GOMP_SPINCOUNT": "50"}, "50 None"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),
    ):
        out = _run_probe(tmp_path, PAGODA_TCMALLOC="0", **env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[1] == want
    assert with_omp_spincount({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
