"""Engine processes run under tcmalloc where the machine has it, with OpenMP threads that sleep soon
after their work (engine.allocator)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import allocator
from engine.allocator import (
    ENGINE_OMP_SPIN_S,
    FALLBACK_OMP_SPINCOUNT,
    engine_omp_spincount,
    tcmalloc_path,
    with_omp_spincount,
    with_tcmalloc,
)
from kernels import cpu_spin

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
    count, policy = out.stdout.split("\n")[1].split()
    assert policy == "None" and 1_000 <= int(count) <= 300_000
    for env, want in (
        ({"GOMP_SPINCOUNT": "50"}, "50 None"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),
    ):
        out = _run_probe(tmp_path, PAGODA_TCMALLOC="0", **env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[1] == want
    assert with_omp_spincount({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.skipif(cpu_spin.turn_seconds() is None, reason="no C compiler to time a spin turn with")
def test_the_spin_count_is_a_time_on_this_cpu_whatever_a_turn_lasts(tmp_path):
    # A fixed count spun 33 us on a Xeon (10.9 ns a turn), too short to cross the gaps inside a step.
    out = _run_probe(tmp_path, PAGODA_TCMALLOC="0")
    assert out.returncode == 0, out.stderr
    count = int(out.stdout.split("\n")[1].split()[0])
    turn = cpu_spin.turn_seconds()
    assert turn is not None and 0.2e-9 < turn < 1e-6
    if 1_000 < count < 300_000:  # within the bounds, the count spins ENGINE_OMP_SPIN_S
        assert 0.5 * ENGINE_OMP_SPIN_S <= count * turn <= 2 * ENGINE_OMP_SPIN_S


@pytest.mark.parametrize(
    ("turn", "count"),
    [(10e-9, 15_000), (1e-9, 150_000), (0.1e-9, 300_000), (1e-6, 1_000), (None, FALLBACK_OMP_SPINCOUNT)],
)
def test_the_spin_count_is_the_spin_time_over_a_turn_within_bounds(monkeypatch, turn, count):
    monkeypatch.setattr(cpu_spin, "turn_seconds", lambda: turn)
    engine_omp_spincount.cache_clear()
    try:
        assert allocator.engine_omp_spincount() == count
    finally:
        engine_omp_spincount.cache_clear()
