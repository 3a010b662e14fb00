"""Helpers shared by the test packages: waiting on a condition with a deadline, API key headers,
logged-in clients."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

# The world's model when it registers none: a name the tenants may use, served by nothing.
MODEL = "tiny-llama"
# Every user of the fixture world has this password (the dashboard tests log in with it).
PASSWORD = "correct horse battery staple"


def wait_until(
    predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.02, what: str = "the condition"
) -> T:
    """Call `predicate` until it returns something truthy and return that; AssertionError naming
    `what` if it has not by `timeout` seconds. The predicate may raise to give up early."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {value!r}")
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "the condition",
) -> T:
    """`wait_until` for async tests: the event loop keeps running between tries, and the predicate
    may be a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {value!r}")
        await asyncio.sleep(interval)


def bearer(raw_key: str) -> dict[str, str]:
    """The API key header, as keyword arguments of Django's (and DRF's) test client."""
    return {"HTTP_AUTHORIZATION": f"Bearer {raw_key}"}


def logged_in(user: Any, *, enforce_csrf: bool = False):
    """A Django test client with `user` logged in."""
    from django.test import Client

    client = Client(enforce_csrf_checks=enforce_csrf)
    client.force_login(user)
    return client


async def api_post(world: Any, path: str, body: dict, raw_key: str | None = None):
    """POST `body` as JSON to the API with the world's key of A (or `raw_key`), from async tests."""
    import json

    from django.test import AsyncClient

    return await AsyncClient().post(
        path, json.dumps(body), content_type="application/json", headers=world.headers(raw_key)
    )


def sse_events(raw: bytes) -> list[str]:
    """The data of each server-sent event in `raw`."""
    return [e[len("data: ") :] for e in raw.decode().split("\n\n") if e]


def usage_row(
    key: Any,
    *,
    model: str,
    prompt: int,
    completion: int,
    request_id: str,
    created_at: Any = None,
    status: str = "success",
    adapter: str | None = None,
    cached: int = 0,
) -> Any:
    """A ledger row of ``key``'s tenant written as the platform writes one (usage_record_create),
    dated ``created_at`` when given (the dashboards chart rows by day and hour)."""
    from tenants.models import UsageRecord
    from tenants.services import usage_record_create

    record = usage_record_create(
        tenant_id=key.tenant_id,
        api_key_id=key.pk,
        model=model,
        adapter=adapter,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        time_to_first_token_ms=20.0,
        latency_ms=300.0,
        status=status,
        request_id=request_id,
    )
    if created_at is not None:
        UsageRecord.objects.filter(pk=record.pk).update(created_at=created_at)
        record.refresh_from_db()
    return record


def acme(**overrides: Any) -> dict[str, Any]:
    """The dashboard tests' tenant: Acme Research, with limits and two models (make_world's tenant_a)."""
    return {
        "name": "Acme Research",
        "slug": "acme",
        "requests_per_minute": 600,
        "tokens_per_minute": 90_000,
        "max_concurrent_requests": 8,
        "monthly_token_quota": 1_000_000,
        "allowed_models": ["tiny-llama", "tiny-qwen"],
        **overrides,
    }
