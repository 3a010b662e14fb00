"""Usage page data: the ledger selectors' buckets shaped for the charts and tables."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta

from tenants.selectors import usage_summary

PERIOD_CHOICES = (7, 30, 90)
DEFAULT_PERIOD = 30
_COUNTERS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens")


@dataclass(frozen=True, slots=True)
class UsageReport:
    start: date
    end: date
    daily: list[dict]  # one row per day, oldest first, zero rows included so charts keep the time axis
    by_model: list[dict]  # biggest token users first
    totals: dict[str, int]

    def chart_daily(self) -> list[dict]:
        return [
            {
                "day": row["day"].isoformat(),
                "requests": row["requests"],
                "prompt": row["prompt_tokens"],
                "completion": row["completion_tokens"],
            }
            for row in self.daily
        ]

    def chart_models(self) -> list[dict]:
        return [
            {
                "model": row["model"],
                "requests": row["requests"],
                "prompt": row["prompt_tokens"],
                "completion": row["completion_tokens"],
            }
            for row in self.by_model
        ]


def period_days(raw: str | None) -> int:
    try:
        days = int(raw or DEFAULT_PERIOD)
    except ValueError:
        return DEFAULT_PERIOD
    return days if days in PERIOD_CHOICES else DEFAULT_PERIOD


def _counts(row: dict) -> dict[str, int]:
    return {name: int(row.get(name) or 0) for name in _COUNTERS}


def usage_report(*, tenant_id: int, days: int, today: date) -> UsageReport:
    start = today - timedelta(days=days - 1)
    per_day = {
        row["day"]: _counts(row)
        for row in usage_summary(tenant_id=tenant_id, start=start, end=today, group_by=("day",))
    }
    daily = []
    for offset in range(days):
        day = start + timedelta(days=offset)
        daily.append({"day": day, **per_day.get(day, dict.fromkeys(_COUNTERS, 0))})
    by_model = [
        {"model": row["model"], **_counts(row)}
        for row in usage_summary(tenant_id=tenant_id, start=start, end=today, group_by=("model",))
    ]
    by_model.sort(key=lambda r: (-(r["prompt_tokens"] + r["completion_tokens"]), r["model"]))
    totals = {name: sum(row[name] for row in daily) for name in _COUNTERS}
    return UsageReport(start=start, end=today, daily=daily, by_model=by_model, totals=totals)
