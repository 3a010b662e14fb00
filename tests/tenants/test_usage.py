from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from django.utils import timezone

from tenants.models import UsageDaily, UsageRecord
from tenants.selectors import quota_used_this_month
from tenants.services import usage_rollup
from tenants.tasks import usage_rollup_day, usage_rollup_recent
from tests.helpers import MODEL, bearer, usage_row

DAY1, DAY2 = date(2026, 3, 9), date(2026, 3, 10)


def _record(
    world,
    request_id: str,
    *,
    key=None,
    model: str = MODEL,
    adapter=None,
    prompt=10,
    completion=5,
    cached=0,
    status="success",
    at: datetime | None = None,
) -> UsageRecord:
    key = key or world.key_a
    return usage_row(
        key,
        model=model,
        adapter=adapter,
        prompt=prompt,
        completion=completion,
        cached=cached,
        status=status,
        request_id=request_id,
        created_at=at,
    )


def _at(day: date, hour: int) -> datetime:
    return datetime(day.year, day.month, day.day, hour, tzinfo=UTC)


def test_one_ledger_row_per_request_and_a_repeat_is_a_no_op(world):
    first = _record(world, "req-1", prompt=7, completion=3, cached=2)
    again = _record(world, "req-1", prompt=999, completion=999)
    assert again.pk == first.pk
    assert UsageRecord.objects.count() == 1
    row = UsageRecord.objects.get()
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens, row.total_tokens) == (7, 3, 2, 10)
    assert (row.tenant_id, row.api_key_id, row.model, row.adapter) == (
        world.tenant_a.pk,
        world.key_a.pk,
        MODEL,
        None,
    )


def test_the_ledger_has_no_place_for_prompt_or_output_text():
    text_fields = {
        f.name for f in UsageRecord._meta.get_fields() if f.get_internal_type() in {"TextField", "JSONField"}
    }
    assert text_fields == set()


def test_unknown_status_is_refused(world):
    with pytest.raises(ValueError, match="status"):
        _record(world, "bad", status="great")
    assert UsageRecord.objects.count() == 0


def _daily_rows() -> list[tuple]:
    return sorted(
        UsageDaily.objects.values_list(
            "day",
            "tenant_id",
            "api_key_id",
            "model",
            "adapter",
            "requests",
            "errors",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
        )
    )


def test_rollups_are_idempotent_and_follow_the_ledger(world):
    _record(world, "a1", prompt=10, completion=5, cached=4, at=_at(DAY1, 1))
    _record(world, "a2", prompt=20, completion=7, status="error", at=_at(DAY1, 23))
    _record(world, "a3", adapter="sql-lora", prompt=3, completion=1, at=_at(DAY1, 12))
    _record(world, "b1", key=world.key_b, prompt=100, completion=50, at=_at(DAY1, 5))
    _record(world, "a4", prompt=1, completion=1, at=_at(DAY2, 0))  # the next day

    assert usage_rollup(day=DAY1) == 3
    first = _daily_rows()
    assert usage_rollup(day=DAY1) == 3
    assert _daily_rows() == first
    a, b = world.key_a, world.key_b
    assert first == [
        (DAY1, a.tenant_id, a.pk, MODEL, "", 2, 1, 30, 12, 4),
        (DAY1, a.tenant_id, a.pk, MODEL, "sql-lora", 1, 0, 3, 1, 0),
        (DAY1, b.tenant_id, b.pk, MODEL, "", 1, 0, 100, 50, 0),
    ]
    # A late row for the same day updates its bucket in place.
    _record(world, "a5", prompt=5, completion=5, at=_at(DAY1, 23))
    usage_rollup_day(DAY1.isoformat())
    assert UsageDaily.objects.filter(day=DAY1).count() == 3
    bucket = UsageDaily.objects.get(day=DAY1, api_key=a, adapter="")
    assert (bucket.requests, bucket.prompt_tokens, bucket.completion_tokens) == (3, 35, 17)


def test_the_beat_task_rolls_up_today_and_yesterday(world):
    now = timezone.now()
    _record(world, "today", prompt=4, completion=4)
    _record(world, "yesterday", prompt=2, completion=2, at=now - timedelta(days=1))
    result = usage_rollup_recent()
    assert result == {(now.date() - timedelta(days=1)).isoformat(): 1, now.date().isoformat(): 1}
    assert UsageDaily.objects.get(day=now.date()).prompt_tokens == 4


def test_quota_used_this_month_counts_this_months_ledger_only(world):
    now = timezone.now()
    _record(world, "now", prompt=30, completion=12)
    _record(
        world,
        "last-month",
        prompt=500,
        completion=500,
        at=now.replace(day=1, hour=0, minute=0, second=0) - timedelta(hours=1),
    )
    _record(world, "other-tenant", key=world.key_b, prompt=70, completion=0)
    assert quota_used_this_month(tenant_id=world.tenant_a.pk) == 42


def test_usage_api_groups_by_several_dimensions_at_once(world, api_client):
    _record(world, "a1", prompt=10, completion=5, at=_at(DAY1, 3))
    _record(world, "a2", prompt=1, completion=1, at=_at(DAY1, 4))
    _record(world, "a3", model="other-model", prompt=20, completion=10, at=_at(DAY1, 5))
    _record(world, "a4", prompt=7, completion=0, at=_at(DAY2, 3))
    query = {"start": "2026-03-01", "end": "2026-03-31", "group_by": "day,model"}

    body = api_client.get("/v1/usage", query, **bearer(world.raw_key_a)).json()

    assert body["group_by"] == "day,model"
    assert [(b["date"], b["model"], b["requests"], b["total_tokens"]) for b in body["data"]] == [
        ("2026-03-09", "other-model", 1, 30),
        ("2026-03-09", MODEL, 2, 17),
        ("2026-03-10", MODEL, 1, 7),
    ]


@pytest.mark.parametrize("group_by", ["week", "day,day", "day,", "model,key,model"])
def test_usage_api_refuses_unknown_or_repeated_dimensions(world, api_client, group_by):
    response = api_client.get("/v1/usage", {"group_by": group_by}, **bearer(world.raw_key_a))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "group_by"


def test_usage_api_groups_the_callers_tenant_only(world, api_client):
    _record(world, "a1", prompt=10, completion=5, cached=2, at=_at(DAY1, 3))
    _record(world, "a2", model="other-model", prompt=20, completion=10, status="error", at=_at(DAY2, 3))
    _record(world, "b1", key=world.key_b, prompt=1000, completion=1000, at=_at(DAY1, 3))
    query = {"start": "2026-03-01", "end": "2026-03-31"}

    by_day = api_client.get("/v1/usage", {**query, "group_by": "day"}, **bearer(world.raw_key_a)).json()
    assert by_day["object"] == "list"
    assert (by_day["start"], by_day["end"], by_day["group_by"]) == ("2026-03-01", "2026-03-31", "day")
    assert by_day["data"] == [
        {
            "date": "2026-03-09",
            "requests": 1,
            "errors": 0,
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "cached_tokens": 2,
            "total_tokens": 15,
            "billed_tokens": 15.0,
        },
        {
            "date": "2026-03-10",
            "requests": 1,
            "errors": 1,
            "prompt_tokens": 20,
            "completion_tokens": 10,
            "cached_tokens": 0,
            "total_tokens": 30,
            "billed_tokens": 30.0,
        },
    ]
    by_model = api_client.get("/v1/usage", {**query, "group_by": "model"}, **bearer(world.raw_key_a)).json()
    assert [(b["model"], b["total_tokens"]) for b in by_model["data"]] == [("other-model", 30), (MODEL, 15)]
    by_key = api_client.get("/v1/usage", {**query, "group_by": "key"}, **bearer(world.raw_key_a)).json()
    assert by_key["data"] == [
        {
            "api_key_id": world.key_a.pk,
            "api_key_prefix": world.key_a.display_prefix,
            "api_key_name": "a-key",
            "requests": 2,
            "errors": 1,
            "prompt_tokens": 30,
            "completion_tokens": 15,
            "cached_tokens": 2,
            "total_tokens": 45,
            "billed_tokens": 45.0,
        },
    ]


def test_batch_lines_are_billed_at_their_price_factor(world, api_client):
    _record(world, "i1", prompt=10, completion=10, at=_at(DAY1, 3))
    line = _record(world, "batch_x-0-1", prompt=30, completion=10, at=_at(DAY1, 4))
    UsageRecord.objects.filter(pk=line.pk).update(batch_id="batch_x", price_factor="0.5")
    query = {"start": "2026-03-01", "end": "2026-03-31", "group_by": "day"}
    [bucket] = api_client.get("/v1/usage", query, **bearer(world.raw_key_a)).json()["data"]
    assert (bucket["total_tokens"], bucket["billed_tokens"]) == (60, 40.0)


def test_usage_range_is_inclusive_and_defaults_to_the_last_30_days(world, api_client):
    today = timezone.now().date()
    _record(world, "old", at=timezone.now() - timedelta(days=40))
    _record(world, "recent", prompt=1, completion=1)
    body = api_client.get("/v1/usage", **bearer(world.raw_key_a)).json()
    assert (body["start"], body["end"]) == ((today - timedelta(days=29)).isoformat(), today.isoformat())
    assert [b["requests"] for b in body["data"]] == [1]
    one_day = api_client.get(
        "/v1/usage", {"start": today.isoformat(), "end": today.isoformat()}, **bearer(world.raw_key_a)
    ).json()
    assert [b["date"] for b in one_day["data"]] == [today.isoformat()]


@pytest.mark.parametrize(
    ("query", "param", "code"),
    [
        ({"start": "2026-13-01"}, "start", "invalid"),
        ({"end": "yesterday"}, "end", "invalid"),
        ({"start": "2026-03-10", "end": "2026-03-01"}, "start", "invalid_range"),
        ({"start": "2024-01-01", "end": "2026-01-01"}, "start", "invalid_range"),
        ({"group_by": "hour"}, "group_by", "invalid_choice"),
        ({"granularity": "day"}, "granularity", "unknown_parameter"),
        ({"end": "9999-12-31"}, "end", "invalid_range"),
        ({"end": "0001-01-05"}, "end", "invalid_range"),
        ({"start": "0001-01-01", "end": "0001-01-02"}, "start", "invalid_range"),
        ({"start": "1969-12-31", "end": "1970-01-01"}, "start", "invalid_range"),
    ],
)
def test_bad_usage_queries_get_400_in_openai_shape_with_the_param(world, api_client, query, param, code):
    response = api_client.get("/v1/usage", query, **bearer(world.raw_key_a))
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_celery_beat_schedules_the_rollup_and_the_task_rolls_up(world):
    from celery.beat import Scheduler

    from config.celery_app import app

    _record(world, "today", prompt=3, completion=2)
    app.loader.import_default_modules()
    entries = [
        entry
        for entry in Scheduler(app=app).schedule.values()
        if entry.task == "tenants.tasks.usage_rollup_recent"
    ]

    assert [entry.name for entry in entries] == ["tenants-usage-rollup"]
    assert 0 < entries[0].schedule.run_every.total_seconds() <= 3600
    today = timezone.now().date().isoformat()
    assert app.tasks[entries[0].task].apply().get()[today] == 1
    assert UsageDaily.objects.get(day=timezone.now().date()).prompt_tokens == 3


def test_usage_api_answers_csv_with_a_row_per_day_model_and_key_of_the_callers_tenant(world, api_client):
    world.key_a.name = "=HYPERLINK(evil)"  # a spreadsheet must not run a key's name as a formula
    world.key_a.save(update_fields=["name"])
    _record(world, "a1", prompt=10, completion=5, cached=2, at=_at(DAY1, 3))
    _record(world, "a2", prompt=1, completion=1, status="error", at=_at(DAY1, 4))
    _record(world, "a3", model="other-model", prompt=20, completion=10, at=_at(DAY2, 5))
    _record(world, "b1", key=world.key_b, prompt=1000, completion=1000, at=_at(DAY1, 3))
    query = {"start": "2026-03-01", "end": "2026-03-31", "format": "csv"}

    response = api_client.get("/v1/usage", query, **bearer(world.raw_key_a))

    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == (
        f'attachment; filename="usage-{world.tenant_a.slug}-2026-03-01-2026-03-31.csv"'
    )
    prefix = world.key_a.display_prefix
    assert response.content.decode().splitlines() == [
        "date,model,api_key_prefix,api_key_name,requests,errors,prompt_tokens,completion_tokens,"
        "cached_tokens,total_tokens,billed_tokens",
        f"2026-03-09,{MODEL},{prefix},'=HYPERLINK(evil),2,1,11,6,2,17,17",
        f"2026-03-10,other-model,{prefix},'=HYPERLINK(evil),1,0,20,10,0,30,30",
    ]


def test_usage_csv_takes_the_dimensions_asked_for(world, api_client):
    _record(world, "a1", prompt=10, completion=5, at=_at(DAY1, 3))
    _record(world, "a3", model="other-model", prompt=20, completion=10, at=_at(DAY2, 5))
    query = {"start": "2026-03-01", "end": "2026-03-31", "format": "csv", "group_by": "model"}

    response = api_client.get("/v1/usage", query, **bearer(world.raw_key_a))

    assert response.content.decode().splitlines()[1:] == [
        "other-model,1,0,20,10,0,30,30",
        f"{MODEL},1,0,10,5,0,15,15",
    ]


def test_usage_api_refuses_an_unknown_format(world, api_client):
    response = api_client.get("/v1/usage", {"format": "xml"}, **bearer(world.raw_key_a))

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "format"
