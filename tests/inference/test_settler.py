"""The settler: what a dead web process or a database outage left behind is billed exactly once.

The engines' side is what a replica writes (engine/worker/queue.py): each engine request's last
event as its usage record, under engine.protocol.usage_key. Each test has a Redis prefix of its own,
so a sweep sees only what the test left.
"""

from __future__ import annotations

import time
import uuid

import pytest

from core.redis_client import get_redis
from engine.protocol import Event, FinishedOutput, Usage, cancel_request_id, cancel_stream, usage_key
from inference.services.settler import OWNER_ID, owner_beat, settler_sweep
from tenants.models import UsageRecord
from tenants.ratelimit import limiter
from tenants.services import admission_reserve, admission_settle, api_key_authenticate, quota_period
from tenants.types import LedgerEntry, Settlement

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def own_prefix(settings):
    # Under the run's prefix, so the session's clean-up removes these keys too.
    settings.REDIS_PREFIX = f"{settings.REDIS_PREFIX}settler-{uuid.uuid4().hex[:8]}:"


def _reserve(
    world, *, owner: str, engine_requests: dict[str, int], max_tokens: int = 100, keep_running: bool = False
):
    auth = api_key_authenticate(raw_key=world.raw_key_a)
    request_id = uuid.uuid4().hex
    reservation = admission_reserve(
        auth=auth,
        model=world.model,
        prompt_tokens=sum(engine_requests.values()),
        max_tokens=max_tokens,
        request_id=request_id,
        ledger=LedgerEntry(model=world.model, end_user="user-7", service_tier="flex"),
        owner=owner,
        extra={"engine_requests": engine_requests, "bill_completion": True, "keep_running": keep_running},
    )
    return reservation


def _engine_records(events: dict[str, Event]) -> None:
    """Each engine request's last event, as its replica records it."""
    for rid, event in events.items():
        event.replica = "a"
        get_redis().set(usage_key(_prefix(), rid), event.encode()["data"], ex=3600)


def _prefix() -> str:
    from django.conf import settings

    return settings.REDIS_PREFIX


def _counters(world) -> tuple[int, int | None]:
    return (
        limiter.in_flight_count(tenant_id=world.tenant_a.pk),
        limiter.quota_counter_value(tenant_id=world.tenant_a.pk, period=quota_period()),
    )


def test_a_settlement_whose_ledger_row_was_not_written_is_recorded_by_a_sweep_once(world):
    # What a database outage leaves: settled in Redis (counters corrected, slot freed), no row.
    reservation = _reserve(world, owner=OWNER_ID, engine_requests={"e1": 10})
    settled = Settlement(
        prompt_tokens=10, completion_tokens=7, status="success", latency_ms=12.0, finished_at=time.time() - 30
    )
    admission_settle(reservation=reservation, settlement=settled)
    assert not UsageRecord.objects.filter(request_id=reservation.request_id).exists()
    assert _counters(world) == (0, 17)

    assert settler_sweep(min_age_s=0).recorded == 1
    row = UsageRecord.objects.get(request_id=reservation.request_id)
    assert (row.prompt_tokens, row.completion_tokens, row.status, row.end_user, row.service_tier) == (
        10,
        7,
        "success",
        "user-7",
        "flex",
    )
    # Dated when the request ended, not when the database came back.
    assert abs(row.created_at.timestamp() - settled.finished_at) < 1
    assert not get_redis().exists(
        limiter.Keys(tenant_id=world.tenant_a.pk, api_key_id=0).reservation(row.request_id)
    )
    assert settler_sweep(min_age_s=0).recorded == 0
    assert UsageRecord.objects.filter(request_id=reservation.request_id).count() == 1
    assert _counters(world) == (0, 17)


def test_a_second_settle_keeps_the_first_ones_counts(world):
    reservation = _reserve(world, owner=OWNER_ID, engine_requests={"e1": 10})
    first = admission_settle(
        reservation=reservation, settlement=Settlement(prompt_tokens=10, completion_tokens=3)
    )
    second = admission_settle(
        reservation=reservation, settlement=Settlement(prompt_tokens=10, completion_tokens=90)
    )
    assert (first.completion_tokens, second.completion_tokens) == (3, 3)
    assert _counters(world) == (0, 13)


def test_a_live_owners_requests_are_left_to_it(world):
    owner_beat()  # this process's owner key is fresh
    reservation = _reserve(world, owner=OWNER_ID, engine_requests={"e1": 10})
    _engine_records({"e1": Event.finished([FinishedOutput(index=0, finish_reason="stop")], Usage(10, 5))})
    assert settler_sweep(min_age_s=0).settled == 0
    assert not UsageRecord.objects.filter(request_id=reservation.request_id).exists()
    assert _counters(world)[0] == 1


def test_a_dead_owners_finished_request_is_billed_from_the_engines_records(world):
    first, second = (f"e-{uuid.uuid4().hex[:6]}" for _ in range(2))
    engine = {first: 12, second: 8}
    reservation = _reserve(world, owner="web-that-died", engine_requests=engine)
    _engine_records(
        {
            first: Event.finished(
                [FinishedOutput(index=0, finish_reason="stop")], Usage(12, 30, cached_tokens=4)
            ),
            second: Event.finished([FinishedOutput(index=0, finish_reason="length")], Usage(8, 100)),
        }
    )
    assert settler_sweep(min_age_s=0).settled == 1
    row = UsageRecord.objects.get(request_id=reservation.request_id)
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens, row.status) == (
        20,
        130,
        4,
        "success",
    )
    assert _counters(world) == (0, 150)
    # The engines' records went with the settlement.
    assert get_redis().exists(*(usage_key(_prefix(), rid) for rid in engine)) == 0


def test_a_dead_owners_running_request_is_cancelled_then_billed_for_what_it_produced(world):
    rid = f"e-{uuid.uuid4().hex[:6]}"
    reservation = _reserve(world, owner="web-that-died", engine_requests={rid: 10}, max_tokens=1000)
    counts = settler_sweep(min_age_s=0)
    assert (counts.cancelled, counts.settled) == (1, 0)
    cancels = get_redis().xrange(cancel_stream(_prefix(), world.model))
    assert [cancel_request_id(fields) for _, fields in cancels] == [rid]
    # Still running: the next sweep waits for the engine, and cancels nothing twice.
    assert settler_sweep(min_age_s=0).waiting == 1
    assert len(get_redis().xrange(cancel_stream(_prefix(), world.model))) == 1

    # The engine aborts it within a step and records what it produced.
    _engine_records({rid: Event.finished([FinishedOutput(index=0, finish_reason="abort")], Usage(10, 42))})
    assert settler_sweep(min_age_s=0).settled == 1
    row = UsageRecord.objects.get(request_id=reservation.request_id)
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (10, 42, "cancelled")
    assert _counters(world) == (0, 52)


def test_a_dead_batch_runners_line_runs_on_for_its_successor_and_is_billed_once_it_ends(world):
    rid = f"batch_x-0-1-{uuid.uuid4().hex[:6]}"
    reservation = _reserve(world, owner="runner-that-died", engine_requests={rid: 10}, keep_running=True)
    # Nobody cancels it: the runner that replaces the dead one reads its output.
    assert settler_sweep(min_age_s=0).waiting == 1
    assert settler_sweep(min_age_s=0).cancelled == 0
    assert get_redis().xrange(cancel_stream(_prefix(), world.model)) == []
    assert not UsageRecord.objects.filter(request_id=reservation.request_id).exists()
    _engine_records({rid: Event.finished([FinishedOutput(index=0, finish_reason="length")], Usage(10, 100))})
    assert settler_sweep(min_age_s=0).settled == 1
    row = UsageRecord.objects.get(request_id=reservation.request_id)
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (10, 100, "success")


def test_a_dead_owners_request_no_engine_answers_is_billed_from_its_stream_after_the_grace(
    world, monkeypatch
):
    from inference.services import settler

    rid = f"e-{uuid.uuid4().hex[:6]}"
    reservation = _reserve(world, owner="web-that-died", engine_requests={rid: 10})
    assert settler_sweep(min_age_s=0).cancelled == 1
    # Its replica wrote three tokens and died with it; no replica will answer the request.
    from engine.protocol import DeltaOutput, output_stream

    for token in (5, 6, 7):
        get_redis().xadd(
            output_stream(_prefix(), rid),
            Event.delta([DeltaOutput(index=0, text="x", token_ids=[token])]).encode(),
        )
    monkeypatch.setattr(settler, "ABANDONED_GRACE_S", 0.0)
    assert settler_sweep(min_age_s=0).settled == 1
    row = UsageRecord.objects.get(request_id=reservation.request_id)
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (10, 3, "error")
    assert _counters(world) == (0, 13)
