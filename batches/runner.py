"""The batch runner: a tenant's batches, oldest first, fed to the engines at the `flex` tier.

One runner per tenant at a time holds the tenant's lease in Redis (renewed while it runs; a runner
that dies loses it after BATCH_RUNNER_LEASE_S, and the batches-resume beat task starts another).
So a tenant has at most BATCH_MAX_IN_FLIGHT lines in flight, and no line is run by two runners.
A batch's loop reads its status before it feeds each line: `cancelling` or a passed window stops
the feeding at once; the lines in flight finish; then the batch is finalized.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from django.conf import settings
from django.utils import timezone

from batches.lines import check_body, line_run
from batches.models import Batch, BatchRequest
from batches.services import batch_finalize, batch_line_finish, batch_validate
from core.concurrency import blocking
from core.errors import AuthenticationError
from core.redis_client import get_async_redis, rkey
from inference.services.warm import models_warm
from tenants.services import api_key_context

logger = logging.getLogger(__name__)

# Seconds a line that found no capacity (or the tenant's rate limits) waits before it is tried again.
RETRY_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def lease_key(tenant_id: int) -> str:
    return rkey("batch-runner", tenant_id)


class Lease:
    """The tenant's runner lease: taken with SET NX, renewed and released only by its holder."""

    def __init__(self, tenant_id: int) -> None:
        self.key = lease_key(tenant_id)
        self.token = secrets.token_hex(8)
        self.ms = int(settings.BATCH_RUNNER_LEASE_S * 1000)

    async def take(self) -> bool:
        return bool(await get_async_redis().set(self.key, self.token, nx=True, px=self.ms))

    async def keep(self) -> None:
        while True:
            await asyncio.sleep(self.ms / 3000)
            if not await get_async_redis().eval(_RENEW, 1, self.key, self.token, self.ms):
                logger.warning("batch runner lease %s was lost", self.key)
                return

    async def release(self) -> None:
        await get_async_redis().eval(_RELEASE, 1, self.key, self.token)


async def tenant_run(tenant_id: int) -> int:
    """Run the tenant's active batches while holding its lease; returns how many were run (0: the
    lease is held by another runner)."""
    lease = Lease(tenant_id)
    if not await lease.take():
        return 0
    keeper = asyncio.ensure_future(lease.keep())
    ran = 0
    try:
        while not keeper.done():
            batch = await blocking(_next_batch)(tenant_id)
            if batch is None:
                break
            await batch_run(batch.id, lease_lost=keeper)
            ran += 1
    finally:
        keeper.cancel()
        await lease.release()
    return ran


def _next_batch(tenant_id: int) -> Batch | None:
    return (
        Batch.objects.filter(tenant_id=tenant_id, status__in=Batch.ACTIVE)
        .order_by("created_at", "id")
        .first()
    )


async def batch_run(batch_id: str, *, lease_lost: asyncio.Future | None = None) -> None:
    """Validate the batch if it is new, feed its pending lines, and finalize it."""
    batch = await blocking(batch_validate)(batch_id=batch_id, check_body=check_body)
    if batch.status == Batch.Status.FAILED:
        return
    try:
        auth = await blocking(api_key_context)(api_key_id=batch.api_key_id)
    except AuthenticationError as exc:
        auth = exc  # every line fails with it
    in_flight: dict[asyncio.Task, int] = {}
    retry_at: dict[int, float] = {}
    failures: dict[int, int] = {}
    try:
        while lease_lost is None or not lease_lost.done():
            batch = await blocking(Batch.objects.get)(id=batch_id)
            now = timezone.now()
            stopped = batch.status != Batch.Status.IN_PROGRESS or now >= batch.expires_at
            if not stopped:
                free = settings.BATCH_MAX_IN_FLIGHT - len(in_flight)
                waiting = [i for i, at in retry_at.items() if at > time.monotonic()]
                rows = await blocking(_pending_rows)(batch_id, set(in_flight.values()) | set(waiting), free)
                if not rows and not in_flight and not waiting:
                    break  # every line has its outcome
                window_s = (batch.expires_at - now).total_seconds()
                for row in rows:
                    retry_at.pop(row.id, None)
                    task = asyncio.ensure_future(_line(auth, batch, row, window_s))
                    in_flight[task] = row.id
            if not in_flight:
                if stopped:
                    break
                await asyncio.sleep(0.5)  # lines waiting to be tried again
                continue
            done, _ = await asyncio.wait(in_flight, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                line_id = in_flight.pop(task)
                if task.result():  # to be tried again
                    failures[line_id] = failures.get(line_id, 0) + 1
                    backoff = RETRY_BACKOFF_S[min(failures[line_id], len(RETRY_BACKOFF_S)) - 1]
                    retry_at[line_id] = time.monotonic() + backoff
    finally:
        if in_flight:  # the lease was lost or the task is being stopped: leave them to the next runner
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
    if lease_lost is None or not lease_lost.done():
        await blocking(batch_finalize)(batch_id=batch_id)


def _pending_rows(batch_id: str, busy: set[int], limit: int) -> list[BatchRequest]:
    if limit <= 0:
        return []
    return list(
        BatchRequest.objects.filter(batch_id=batch_id, status=BatchRequest.Status.PENDING)
        .exclude(id__in=busy)
        .order_by("index")[:limit]
    )


async def _line(auth: Any, batch: Batch, row: BatchRequest, window_s: float) -> bool:
    """Run a line and record its outcome; True when it is to be tried again."""
    if isinstance(auth, AuthenticationError):
        response = {"status_code": auth.status_code, "request_id": "", "body": auth.as_body()}
        await blocking(batch_line_finish)(line_id=row.id, response=response, error=None)
        return False
    try:
        outcome = await line_run(
            auth=auth,
            batch_id=batch.id,
            endpoint=batch.endpoint,
            line_id=row.id,
            index=row.index,
            body=row.body or {},
            attempt=row.attempt,
            window_s=window_s,
        )
        if outcome.retry:
            return True
        await blocking(batch_line_finish)(line_id=row.id, response=outcome.response, error=outcome.error)
    except Exception:  # the database or Redis away: the line is tried again (its attempt is on record)
        logger.exception("batch %s line %d failed to run; it will be tried again", batch.id, row.index)
        return True
    return False


def runner_warm() -> None:
    """Load the tokenizers of the enabled models (a worker on the `batches` queue does, once it is
    ready): a batch's first lines would otherwise wait seconds for them, beside a busy replica
    whose runner has little CPU to spare. Logs what it did; a failure leaves it to the lines."""
    started = time.monotonic()
    try:
        loaded = models_warm()
    except Exception:  # the database away: the lines load what they need
        logger.exception("batch runner warm-up failed")
        return
    logger.info("batch runner warm: %d tokenizers loaded in %.1f s", loaded, time.monotonic() - started)


def tenants_to_resume() -> list[int]:
    """Tenants with an active batch (the beat task starts a runner for each; one whose lease is
    held returns at once)."""
    return sorted(set(Batch.objects.filter(status__in=Batch.ACTIVE).values_list("tenant_id", flat=True)))
