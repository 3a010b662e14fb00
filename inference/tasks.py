"""Celery tasks: thin wrappers around services, safe to run twice."""

from __future__ import annotations

from celery import shared_task

from inference.services import adapters, settler, stored_responses


@shared_task(name=adapters.VALIDATE_TASK)
def adapter_validate(adapter_id: int, version: str) -> str:
    """Validate one stored adapter version (scheduled on commit of its upload)."""
    return adapters.adapter_validate(adapter_id=adapter_id, version=version)


@shared_task(name="inference.tasks.adapter_validate_lost")
def adapter_validate_lost() -> int:
    """Periodic: queue validation again for adapters whose result never came."""
    return adapters.adapter_validate_lost()


@shared_task(name="inference.tasks.settlements_sweep")
def settlements_sweep() -> dict[str, int]:
    """Periodic: settle what web processes that died left behind, and write the ledger rows that
    waited for the database (the web processes sweep too; one sweep runs at a time)."""
    counts = settler.settler_sweep()
    return {name: getattr(counts, name) for name in counts.__slots__}


@shared_task(name="inference.tasks.stored_responses_expire")
def stored_responses_expire() -> int:
    """Periodic: delete the Responses API's stored responses past their expiry."""
    return stored_responses.stored_responses_expire()
