"""The environment an engine process runs in on CPU: tcmalloc when the machine has it, and OpenMP
threads that stop spinning soon after their work ends.

A CPU forward allocates and frees activations of megabytes to tens of megabytes per layer. glibc's
malloc hands chunks that size back to the kernel on free and takes them again with fresh page
faults on the next allocation: on SmolLM2 a 2,048-token prefill step took 4.2 s under glibc and
2.1 s under tcmalloc, which keeps freed memory for reuse (vLLM's CPU backend asks for the same
preload). The allocator can only be chosen before the process starts, so an engine process that
was started without it replaces itself with a copy that has it (``reexec_as_engine_process``), and
a launcher may put it in the child's environment (``with_tcmalloc``).

PAGODA_TCMALLOC=0 keeps glibc's malloc; PAGODA_TCMALLOC=/path/to/libtcmalloc.so picks a library.
Debian and Ubuntu ship it as libtcmalloc-minimal4.

GNU OpenMP (torch's CPU runtime, and the C kernels') keeps a thread spinning for 300,000 turns after
each parallel region before it sleeps: between two steps of the engine, and through every wait for
Redis, its threads hold the cores that daphne, Redis and the batch runner beside it need. An engine
process spins for ENGINE_OMP_SPIN_S instead: long enough to cross the gaps between the regions of
one step, short enough to sleep between steps. On a 2-core EPYC, 3,000 turns left SmolLM2's steps as
fast as before (18-19 ms at one sequence, 69-72 ms at 32, against 16-20 and 69-74), and the stack's
capacity rose from 648 to 696 output tok/s and a batch beside interactive traffic from 389 to 587
(bench/batch.py). But a turn's length differs between CPUs (the pause hint: 10.9 ns on a 2-core
Xeon), and there 3,000 turns (33 us) slept inside steps: 9 sequences took 54 ms a step instead of 43,
and 32 took 87 ms instead of 73 (the layer path; 10,000 turns or more ran as fast as the default). So
the count is the spin time over a turn's length, measured once per process by kernels.cpu_spin
(about 1 ms), within 1,000-300,000 turns; where that cannot be measured, FALLBACK_OMP_SPINCOUNT.
OMP_WAIT_POLICY=PASSIVE would sleep at once, 12-30 % slower per step. An environment that sets
GOMP_SPINCOUNT or OMP_WAIT_POLICY itself is left as it is.
"""

from __future__ import annotations

import ctypes.util
import functools
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


ENGINE_OMP_SPIN_S = 150e-6
FALLBACK_OMP_SPINCOUNT = 10_000
_SPINCOUNT_BOUNDS = (1_000, 300_000)


@functools.cache
def engine_omp_spincount() -> int:
    """The GOMP_SPINCOUNT that makes this CPU's OpenMP threads spin for about ENGINE_OMP_SPIN_S."""
    from kernels import cpu_spin

    turn = cpu_spin.turn_seconds()
    if turn is None:
        return FALLBACK_OMP_SPINCOUNT
    low, high = _SPINCOUNT_BOUNDS
    return min(high, max(low, round(ENGINE_OMP_SPIN_S / turn)))


def with_omp_spincount(env: dict[str, str]) -> dict[str, str]:
    """``env`` with GOMP_SPINCOUNT set to engine_omp_spincount(), unless it sets the wait itself."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return env
    return {**env, "GOMP_SPINCOUNT": str(engine_omp_spincount())}


def tcmalloc_loaded() -> bool:
    try:
        return "tcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def reexec_as_engine_process(argv: Sequence[str]) -> None:
    """Replace this process with ``argv`` run under tcmalloc and with the spin count, when that
    differs from what it has (tcmalloc installed and not loaded yet, or the spin count not set);
    returns (doing nothing) otherwise. Call it before any work is done: OpenMP reads its settings
    when it loads."""
    if os.environ.get("_PAGODA_REEXECED"):
        return
    env = with_omp_spincount(dict(os.environ))
    if not tcmalloc_loaded():
        env = with_tcmalloc(env)
    if env == dict(os.environ):
        return
    env["_PAGODA_REEXECED"] = "1"  # never loop, whatever the loader made of the preload
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)
