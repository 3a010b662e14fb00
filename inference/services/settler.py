"""Settling what a dead web process left behind, from what the engines recorded.

Every web process that runs generations is an owner: it keeps a key with a short TTL alive in
Redis (`owner_ensure_beating`), and each reservation it makes names it. While an owner lives it
settles its own requests. `settler_sweep` (run by every web process's settler thread and by a
Celery beat task; one sweep at a time across them) takes the rest:
- a request already settled whose ledger row could not be written (PostgreSQL was down): the row;
- a request whose owner is gone, once every engine request of it has ended: billed from the
  engines' usage records (engine.protocol.usage_key), idempotent by request id;
- a request whose owner is gone and whose engine requests still run: nobody reads them, so they
  are cancelled (except a batch line's: the runner that replaces its dead one reads it, so it runs
  to its end and is billed then) (the engine aborts them within a step and records their usage), and billed on a
  later sweep; after ABANDONED_GRACE_S without a record, from what their output streams show.
Its reservation is then released: the concurrency slot and the tokens reserved beyond the count.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.db import InterfaceError, OperationalError, connections

from core.redis_client import REDIS_CONNECTION_ERRORS, get_redis, rkey
from engine.protocol import Event, ProtocolError, cancel_message, cancel_stream, output_stream, usage_key
from tenants.services import (
    admission_settle,
    settlement_list_open,
    settlement_mark_abandoned,
    settlement_record,
)
from tenants.types import OpenSettlement, Settlement

logger = logging.getLogger(__name__)

# This process, as the owner of the requests it admits. Its key lives settings.OWNER_TTL_S seconds
# and is renewed five times in that; a settler sweeps every settings.SETTLER_SWEEP_S seconds.
OWNER_ID = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
# How long a settler waits, after cancelling an abandoned request, for its engines' usage records
# before billing what its output streams show. A request still queued is aborted when a replica
# takes it, within the replicas' cancel lookback (60 s).
ABANDONED_GRACE_S = 75.0
# How long a gone owner's request that asked to keep running (a batch line) is left to run before
# it is cancelled as any other: longer than a batch's completion window.
KEEP_RUNNING_MAX_S = 2 * 24 * 3600.0
_LOCK_TTL_MS = 60_000
_CANCEL_STREAM_MAXLEN = 10_000


def owner_key(owner: str) -> str:
    return rkey("owner", owner)


def owner_beat() -> None:
    get_redis().set(owner_key(OWNER_ID), b"1", px=int(settings.OWNER_TTL_S * 1000))


_beating = threading.Event()


def owner_ensure_beating() -> None:
    """Keep this process's owner key alive, from a daemon thread started on the first call. That
    call sets the key itself (a blocking Redis call: make it from a thread), so no reservation of
    this process is ever seen without it."""
    if _beating.is_set():
        return
    owner_beat()
    _beating.set()
    threading.Thread(target=_beat_forever, name="settlement-owner", daemon=True).start()


def _beat_forever() -> None:
    failing = False
    while True:
        try:
            owner_beat()
            failing = False
        except Exception as exc:  # Redis unreachable: the requests are settled once it is back
            if not failing:
                logger.warning("cannot keep the owner key alive: %s: %s", exc.__class__.__name__, exc)
            failing = True
        time.sleep(settings.OWNER_TTL_S / 5)


@dataclass(frozen=True, slots=True)
class SweepCounts:
    recorded: int = 0  # ledger rows written for settlements that waited for the database
    settled: int = 0  # requests of gone owners settled
    cancelled: int = 0  # engine requests of gone owners cancelled
    waiting: int = 0  # requests of gone owners waiting for their engines' records


def _engine_requests(open_: OpenSettlement) -> dict[str, int]:
    """Engine request id -> prompt tokens, as the generation kept them at admission."""
    return {str(rid): int(n) for rid, n in dict(open_.extra.get("engine_requests") or {}).items()}


def _settlement_from_engines(
    open_: OpenSettlement, ended: dict[str, Event], unfinished: dict[str, list[Event]]
) -> Settlement:
    prompt = completion = cached = 0
    statuses = set()
    for event in ended.values():
        usage = event.usage or {}
        prompt += int(usage.get("prompt_tokens", 0))
        completion += int(usage.get("completion_tokens", 0))
        cached += int(usage.get("cached_tokens", 0))
        if event.type == "error":
            statuses.add("error")
        elif any(o.get("finish_reason") == "abort" for o in event.outputs):
            statuses.add("cancelled")
    prompts = _engine_requests(open_)
    for rid, events in unfinished.items():  # given up on: billed for what their streams show
        produced = sum(len(o.get("token_ids") or ()) for e in events if e.type == "delta" for o in e.outputs)
        prompt += prompts.get(rid, 0) if events else 0
        completion += produced
        statuses.add("error")
    if not open_.extra.get("bill_completion", True):
        completion = 0
    status = "error" if "error" in statuses else "cancelled" if "cancelled" in statuses else "success"
    return Settlement(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        status=status,
        latency_ms=max(0.0, (time.time() - open_.admitted_at) * 1000.0),
        finished_at=time.time(),
    )


def _usage_records(request_ids: list[str]) -> dict[str, Event]:
    if not request_ids:
        return {}
    raw = get_redis().mget([usage_key(settings.REDIS_PREFIX, rid) for rid in request_ids])
    ended = {}
    for rid, data in zip(request_ids, raw, strict=True):
        if data is None:
            continue
        try:
            ended[rid] = Event.decode({b"data": data})
        except ProtocolError:
            logger.error("unreadable usage record of engine request %s", rid)
    return ended


def _stream_events(request_id: str) -> list[Event]:
    events = []
    for _, fields in get_redis().xrange(output_stream(settings.REDIS_PREFIX, request_id)):
        try:
            events.append(Event.decode(fields))
        except ProtocolError:
            continue
    return events


def _cancel(model: str, request_ids: list[str]) -> None:
    pipe = get_redis().pipeline(transaction=False)
    for rid in request_ids:
        pipe.xadd(
            cancel_stream(settings.REDIS_PREFIX, model),
            cancel_message(rid),
            maxlen=_CANCEL_STREAM_MAXLEN,
            approximate=True,
        )
    pipe.execute()


def _settle_abandoned(open_: OpenSettlement, now: float) -> str:
    """One gone owner's request: 'settled', 'cancelled' (its engines were told) or 'waiting'."""
    engine_requests = list(_engine_requests(open_))
    ended = _usage_records(engine_requests)
    running = [rid for rid in engine_requests if rid not in ended]
    if running and open_.extra.get("keep_running") and now - open_.admitted_at < KEEP_RUNNING_MAX_S:
        # A batch line: the runner that replaces its dead one reads its output, and it ends on its
        # own (max_tokens, and a deadline at the batch's window); it is billed once it has.
        return "waiting"
    if running:
        abandoned_at = open_.abandoned_at
        if abandoned_at is None:
            settlement_mark_abandoned(tenant_id=open_.tenant_id, request_id=open_.request_id)
            _cancel(open_.ledger.model, running)
            logger.info(
                "request %s lost its web process: cancelled %d engine requests",
                open_.request_id,
                len(running),
            )
            return "cancelled"
        if now - abandoned_at < ABANDONED_GRACE_S:
            return "waiting"
    unfinished = {rid: _stream_events(rid) for rid in running}
    settlement = admission_settle(
        reservation=open_.reservation,
        settlement=_settlement_from_engines(open_, ended, unfinished),
        release_keys=[usage_key(settings.REDIS_PREFIX, rid) for rid in engine_requests],
    )
    settlement_record(
        tenant_id=open_.tenant_id,
        api_key_id=open_.api_key_id,
        request_id=open_.request_id,
        ledger=open_.ledger,
        settlement=settlement,
    )
    logger.info("settled request %s of a gone web process: %s", open_.request_id, settlement)
    return "settled"


def settler_sweep(*, limit: int = 500, min_age_s: float = 1.0) -> SweepCounts:
    """One sweep over the open settlements (see the module docstring). Returns what it did;
    nothing when another process is sweeping."""
    client = get_redis()
    lock = rkey("settle", "lock")
    token = uuid.uuid4().hex.encode()
    if not client.set(lock, token, nx=True, px=_LOCK_TTL_MS):
        return SweepCounts()
    counts = {"recorded": 0, "settled": 0, "cancelled": 0, "waiting": 0}
    try:
        now = time.time()
        # Younger ones are in their owner's hands (its key is set before it admits anything).
        open_settlements = settlement_list_open(admitted_before=now - min_age_s, limit=limit)
        owners = {o.owner for o in open_settlements if o.final is None}
        alive = dict(zip(owners, client.mget([owner_key(o) for o in owners]), strict=True)) if owners else {}
        for open_ in open_settlements:
            try:
                if open_.final is not None:
                    settlement_record(
                        tenant_id=open_.tenant_id,
                        api_key_id=open_.api_key_id,
                        request_id=open_.request_id,
                        ledger=open_.ledger,
                        settlement=open_.final,
                    )
                    counts["recorded"] += 1
                elif alive.get(open_.owner) is None:
                    counts[_settle_abandoned(open_, now)] += 1
            except (OperationalError, InterfaceError, *REDIS_CONNECTION_ERRORS):
                raise  # the database or Redis is down: the next sweep tries them all again
            except Exception:  # this one request's row cannot be written; the others can
                logger.exception("cannot settle request %s; left for the next sweep", open_.request_id)
    finally:
        if client.get(lock) == token:
            client.delete(lock)
    return SweepCounts(**counts)


_settler_started = threading.Event()


def settler_start() -> None:
    """Run this process's owner key and a sweep every settings.SETTLER_SWEEP_S (the first one at
    once), in daemon threads: what a web process does from its start."""
    owner_ensure_beating()
    if _settler_started.is_set():
        return
    _settler_started.set()
    threading.Thread(target=_sweep_forever, name="settler", daemon=True).start()


def _sweep_forever() -> None:
    failing = False
    while True:
        try:
            counts = settler_sweep()
            if failing:
                logger.warning("the settler sweeps again")
            failing = False
            if counts.recorded or counts.settled:
                logger.info("settler: %s", counts)
        except Exception as exc:  # Redis or the database is down: the next sweep tries again
            if not failing:
                logger.warning("settler sweep failed (%s: %s); retrying", exc.__class__.__name__, exc)
            failing = True
        finally:
            for connection in connections.all(initialized_only=True):
                connection.close()  # back to the pool: a dead server's connection is not kept
        time.sleep(settings.SETTLER_SWEEP_S)
