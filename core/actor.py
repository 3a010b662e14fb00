"""Who is making the change a request makes: a person (dashboard, admin) or an API key, and from
which address. Set once per request by whoever authenticated it (config.middleware for signed-in
pages, core.api.base for API keys) and read by the audit log (tenants.services.audit), so that a
service records who changed what without every caller passing it along. A context variable: each
request's own, carried into the threads that run its sync code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Actor:
    source: str  # admin | dashboard | api | system (a command, a task)
    user_id: int | None = None
    username: str = ""
    api_key_id: int | None = None
    api_key_prefix: str = ""
    address: str | None = None

    @property
    def label(self) -> str:
        if self.username:
            return self.username
        if self.api_key_prefix:
            return f"key {self.api_key_prefix}"
        return self.source


SYSTEM = Actor(source="system")
_current: ContextVar[Actor] = ContextVar("pagoda_actor", default=SYSTEM)


def current_actor() -> Actor:
    return _current.get()


@contextmanager
def acting_as(actor: Actor) -> Iterator[Actor]:
    """The actor of the changes made inside the block."""
    token = _current.set(actor)
    try:
        yield actor
    finally:
        _current.reset(token)
