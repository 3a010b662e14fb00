"""Typed errors raised by the engine for anything that arrives from outside (requests, wire messages)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's own errors; internal invariants are asserts, not these."""


class RequestTooLargeError(EngineError):
    """A request can never be served: its prompt or its KV cache need exceeds what the engine has."""


class InvalidRequestError(EngineError):
    """A request is malformed (for example an empty prompt)."""
