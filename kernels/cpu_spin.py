"""How long one spin-wait turn of GNU OpenMP takes on this CPU (kernels/cpu/spin_wait.c), built
without OpenMP and loaded without torch, so that a process may ask before its OpenMP runtime loads."""

from __future__ import annotations

import ctypes

from kernels import _cpu_build

_SIGNATURES = {"spin_turn_seconds": (ctypes.c_double, [ctypes.c_int64, ctypes.c_int])}


def turn_seconds(turns: int = 20_000, rounds: int = 5) -> float | None:
    """Seconds per turn, the fastest of ``rounds`` runs of ``turns`` (about 1 ms in all on a
    2-core Xeon); None where the library cannot be built."""
    lib = _cpu_build.load("spin_wait", _SIGNATURES, openmp=False)
    if lib is None:
        return None
    seconds = float(lib.spin_turn_seconds(turns, rounds))
    return seconds if seconds > 0 else None
