"""Whether this web process is still warming up: loading what its first requests would otherwise
wait for (the models' tokenizers and chat templates: seconds of CPU). /ready answers not_ready
until the warm-up ends, so a load balancer sends nothing to a process that would answer its first
requests seconds late; /live answers meanwhile. A process that starts no warm-up (a test's
application, a plain `daphne config.asgi`) is never warming."""

from __future__ import annotations

_warming = False


def mark_warming() -> None:
    global _warming
    _warming = True


def mark_warm() -> None:
    global _warming
    _warming = False


def is_warming() -> bool:
    return _warming
