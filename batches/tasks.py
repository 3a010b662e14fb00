"""Celery tasks of the Batch API: thin, and safe to run twice (a tenant's runner holds a lease)."""

from __future__ import annotations

import asyncio

from celery import shared_task

from batches import runner


@shared_task(name="batches.tasks.batch_run")
def batch_run(tenant_id: int) -> int:
    """Run the tenant's active batches (on the `batches` queue; returns at once when another runner
    holds the tenant's lease)."""
    return asyncio.run(runner.tenant_run(tenant_id))


@shared_task(name="batches.tasks.batches_resume")
def batches_resume() -> int:
    """Periodic: a runner for every tenant with an active batch (a worker that died mid-batch is
    replaced once its lease lapses; a tenant's next batch starts once its runner is free)."""
    tenants = runner.tenants_to_resume()
    for tenant_id in tenants:
        batch_run.delay(tenant_id)
    return len(tenants)
