"""Settlements: from a request's reservation to its one ledger row, durably.

A reservation (admission_reserve) is the request's open settlement: it carries what the ledger row
will say and who settles it. Settling (admission_settle) fixes the counts in Redis, once. The ledger
row is written after that (settlement_record), and only then does the reservation go: while
PostgreSQL is down the settlement waits in Redis, and whoever records it later (the process that
settled it, or a settler's sweep) writes the same row once.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import orjson
from django.db import DatabaseError

from core.redis_client import get_redis
from tenants.models import UsageRecord
from tenants.ratelimit import limiter
from tenants.services.admission import admission_settle, settlement_decode
from tenants.services.usage import usage_record_create
from tenants.types import LedgerEntry, OpenSettlement, Reservation, Settlement

logger = logging.getLogger(__name__)

# Whether the last ledger write of this process failed: one line when the database goes away, one
# when it is back, not one per request.
_ledger_failing = False


def settlement_record(
    *, tenant_id: int, api_key_id: int, request_id: str, ledger: LedgerEntry, settlement: Settlement
) -> UsageRecord:
    """Write the request's ledger row (idempotent by request id), then drop its settled
    reservation. Raises the database's error when the row cannot be written: the settlement stays
    in Redis for the next try."""
    record = usage_record_create(
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        model=ledger.model,
        adapter=ledger.adapter,
        prompt_tokens=settlement.prompt_tokens,
        completion_tokens=settlement.completion_tokens,
        cached_tokens=settlement.cached_tokens,
        time_to_first_token_ms=settlement.time_to_first_token_ms,
        latency_ms=settlement.latency_ms,
        status=settlement.status,
        request_id=request_id,
        end_user=ledger.end_user,
        prompt_cache_key=ledger.prompt_cache_key,
        service_tier=ledger.service_tier,
        batch_id=ledger.batch_id,
        price_factor=ledger.price_factor,
        created_at=datetime.fromtimestamp(settlement.finished_at, tz=UTC) if settlement.finished_at else None,
    )
    keys = limiter.Keys(tenant_id=tenant_id, api_key_id=api_key_id)
    pipe = get_redis().pipeline(transaction=False)
    pipe.delete(keys.reservation(request_id))
    pipe.zrem(limiter.open_settlements_key(), keys.open_member(request_id))
    pipe.execute()
    return record


def settlement_close(
    *,
    reservation: Reservation,
    ledger: LedgerEntry,
    settlement: Settlement,
    release_keys: list[str] = (),
) -> Settlement:
    """Settle a reservation and write its ledger row: what the process that admitted a request does
    when it ends. Returns the settlement that counts (a settler may have settled it first). A
    ledger row that cannot be written is left to settlement_sweep_recorded, and logged."""
    settled = admission_settle(reservation=reservation, settlement=settlement, release_keys=release_keys)
    global _ledger_failing
    try:
        settlement_record(
            tenant_id=reservation.tenant_id,
            api_key_id=reservation.api_key_id,
            request_id=reservation.request_id,
            ledger=ledger,
            settlement=settled,
        )
    except DatabaseError as exc:  # the database is down: the settlement waits in Redis
        if not _ledger_failing:
            logger.warning(
                "cannot write ledger rows (%s: %s); settlements wait in Redis, starting with %s",
                exc.__class__.__name__,
                exc,
                reservation.request_id,
            )
        _ledger_failing = True
    else:
        if _ledger_failing:
            logger.warning("ledger rows are written again")
        _ledger_failing = False
    return settled


def _open_settlement(
    tenant_id: int, request_id: str, admitted_at: float, fields: dict[bytes, bytes]
) -> OpenSettlement | None:
    try:
        meta = orjson.loads(fields[b"meta"])
        final = fields.get(b"final")
        abandoned = fields.get(b"abandoned_at")
        return OpenSettlement(
            tenant_id=tenant_id,
            request_id=request_id,
            api_key_id=int(meta["api_key_id"]),
            quota_period=str(meta.get("period") or ""),
            reserved_tokens=int(fields[b"tokens"]),
            admitted_at=admitted_at,
            ledger=LedgerEntry(**meta["ledger"]),
            owner=str(meta.get("owner") or ""),
            extra=dict(meta.get("extra") or {}),
            final=settlement_decode(final) if final else None,
            abandoned_at=float(abandoned) if abandoned else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        logger.error("unreadable reservation %s:%s: %s", tenant_id, request_id, exc)
        return None


def settlement_list_open(*, admitted_before: float, limit: int = 500) -> list[OpenSettlement]:
    """Reservations admitted before `admitted_before` (unix time) whose ledger row is not written,
    oldest first. Index entries whose reservation is gone (expired, or lost with Redis's data)
    are dropped."""
    client = get_redis()
    index = limiter.open_settlements_key()
    members = client.zrangebyscore(index, "-inf", admitted_before, start=0, num=limit, withscores=True)
    if not members:
        return []
    parsed: list[tuple[bytes, int, str, float]] = []
    for member, score in members:
        tenant, _, request_id = member.decode().partition(":")
        parsed.append((member, int(tenant), request_id, score))
    pipe = client.pipeline(transaction=False)
    for _, tenant_id, request_id, _ in parsed:
        pipe.hgetall(limiter.Keys(tenant_id=tenant_id, api_key_id=0).reservation(request_id))
    found: list[OpenSettlement] = []
    gone: list[bytes] = []
    for (member, tenant_id, request_id, score), fields in zip(parsed, pipe.execute(), strict=True):
        if not fields or b"meta" not in fields:
            gone.append(member)
            continue
        open_ = _open_settlement(tenant_id, request_id, score, fields)
        if open_ is not None:
            found.append(open_)
    if gone:
        client.zrem(index, *gone)
    return found


def settlement_mark_abandoned(*, tenant_id: int, request_id: str) -> float:
    """Note when a settler first found this request's owner gone; returns that time (unix)."""
    key = limiter.Keys(tenant_id=tenant_id, api_key_id=0).reservation(request_id)
    client = get_redis()
    client.hsetnx(key, "abandoned_at", repr(time.time()))
    return float(client.hget(key, "abandoned_at") or time.time())
