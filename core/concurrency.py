"""Blocking work (database, tokenization) run from async code without queueing behind other requests.

asgiref's thread-sensitive `sync_to_async`, Django's default, runs every such call of a process on
one shared thread: one long tokenization there stalls every socket and stream of the process,
Channels' own per-message housekeeping included. `blocking()` runs the call in a thread of the
pool instead and gives that thread's database connections back when it returns, as Django does at
the end of a request: a server's connection goes back to the pool, or is closed, so no idle thread
holds one. A SQLite file's stays open in its thread (CONN_MAX_AGE None), unless an error or a
changed autocommit made it unusable: opening it again, with its pragmas, made a one-row query 0.75
ms instead of 0.1, and a request makes several.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

P = ParamSpec("P")
R = TypeVar("R")


def _releasing_connections(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            for connection in connections.all(initialized_only=True):
                if not connection.in_atomic_block:
                    connection.close_if_unusable_or_obsolete()

    return call


def blocking(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """`fn` as a coroutine function whose calls each run in a thread of the pool."""
    return sync_to_async(_releasing_connections(fn), thread_sensitive=False)
