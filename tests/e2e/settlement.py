"""What every request through the serving stack must leave behind, read from the ledger and Redis:
one ledger row, no reservation or slot, counters equal to what was billed; and what the engine
wrote to a request's output stream."""

from __future__ import annotations

from django.conf import settings
from django.db.models import F, Sum

from core.redis_client import get_redis
from engine.protocol import Event, output_stream
from tenants.models import Tenant, UsageRecord
from tenants.ratelimit import limiter
from tenants.services import quota_period


def assert_settled(tenant: Tenant, request_ids: list[str]) -> None:
    """No reservation, slot or stray token count left: Redis agrees with the ledger."""
    rows = UsageRecord.objects.filter(tenant=tenant)
    assert sorted(rows.values_list("request_id", flat=True)) == sorted(request_ids)
    billed = rows.aggregate(total=Sum(F("prompt_tokens") + F("completion_tokens")))["total"]
    keys = limiter.Keys(tenant_id=tenant.id, api_key_id=0)
    redis = get_redis()
    assert [redis.exists(keys.reservation(rid)) for rid in request_ids] == [0] * len(request_ids)
    assert limiter.in_flight_count(tenant_id=tenant.id) == 0
    assert limiter.quota_counter_value(tenant_id=tenant.id, period=quota_period()) == billed
    assert int(redis.get(keys.tokens("tenant", tenant.id)[2])) == billed


def engine_events(request_id: str) -> list[Event]:
    raw = get_redis().xrange(output_stream(settings.REDIS_PREFIX, request_id))
    return [Event.decode(fields) for _, fields in raw]
