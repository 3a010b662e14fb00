"""A spare-capacity step given up between layers when more important work arrives.

The flex tier (batch lines) runs on spare capacity: while nothing more important runs, its steps
fill the replica. A step is not preempted by the scheduler: a request of a more important tier
that arrives while one runs waits for it to end before its prompt is computed, which on a CPU is
a whole step of the batch's decodes added to its time to first token.

So a step whose every sequence is of the spare-capacity tier (and that carries no speculative
draft) is interruptible: the replica's worker sets `arrived` when a more important request reaches
its streams (engine.worker.arrivals), the model checks it between decoder layers, and the step is
given up there (StepInterrupted). Nothing of it is kept: the scheduler's sequences have not moved
(their computed tokens advance only after a step's outputs), the KV slots it wrote are written
again, the same, by the step that takes its place, and its sampling never ran. What it cost is the
layers computed before the check, once per arrival.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.rules import SPARE_CAPACITY_PRIORITY
from engine.scheduler_output import ScheduledSequence


class StepInterrupted(Exception):
    """The step was given up between layers: a more important request arrived."""


def interruptible(scheduled: list[ScheduledSequence]) -> bool:
    """Whether a step may be given up: every sequence of the spare-capacity tier, no drafts."""
    return bool(scheduled) and all(
        item.seq.priority >= SPARE_CAPACITY_PRIORITY and not item.draft for item in scheduled
    )


def checker(arrived: threading.Event) -> Callable[[], None]:
    """What the model calls between layers: raises StepInterrupted once `arrived` is set."""

    def check() -> None:
        if arrived.is_set():
            raise StepInterrupted

    return check
