"""Where a step's time goes: wall time per phase, summed over the steps of a run.

Off by default (no clock is read); the engine benchmarks switch it on with ``engine.profile =
StepProfile()`` and print ``table()`` so the next person sees which phase to work on.
"""

from __future__ import annotations

import time

PHASES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")


class StepProfile:
    __slots__ = ("seconds", "num_steps", "num_tokens", "_last")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.num_tokens = 0  # tokens computed (prompt and decode) over the profiled steps
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or start) went to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def as_dict(self) -> dict[str, object]:
        total = sum(self.seconds.values())
        steps = max(self.num_steps, 1)
        return {
            "steps": self.num_steps,
            "tokens": self.num_tokens,
            "total_s": round(total, 3),
            "ms_per_step": {p: round(s * 1000 / steps, 3) for p, s in self.seconds.items()},
            "share": {p: round(s / total, 4) if total else 0.0 for p, s in self.seconds.items()},
        }

    def table(self) -> str:
        total = sum(self.seconds.values()) or 1e-9
        steps = max(self.num_steps, 1)
        lines = [f"{'phase':<11} {'total s':>9} {'ms/step':>9} {'share':>7}"]
        for phase, s in self.seconds.items():
            lines.append(f"{phase:<11} {s:>9.2f} {s * 1000 / steps:>9.2f} {s / total:>6.1%}")
        lines.append(f"{'all':<11} {total:>9.2f} {total * 1000 / steps:>9.2f}   ({self.num_steps} steps)")
        return "\n".join(lines)
