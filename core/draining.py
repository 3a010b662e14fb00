"""Whether this web process is draining: on SIGTERM it stopped listening and is finishing the
requests and websockets it has open (config.web_server). /ready answers not_ready from then on,
while /live still answers: the process is up, it only takes nothing new."""

from __future__ import annotations

_draining = False


def mark_draining() -> None:
    global _draining
    _draining = True


def is_draining() -> bool:
    return _draining
