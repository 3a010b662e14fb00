"""A tenant's usage as CSV: the buckets of `tenants.selectors.usage_summary`, one row each.

Cells a spreadsheet would run as a formula (a key's name beginning with =, +, - or @) are written
with a leading apostrophe, so an exported file cannot carry a formula into the reader's sheet.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from datetime import date

from tenants.selectors import usage_summary

# The CSV export's own default: every dimension, so one file answers "which key, which model, which day".
CSV_GROUP_BY = ("day", "model", "key")
_DIMENSION_COLUMNS = {"day": ("date",), "model": ("model",), "key": ("api_key_prefix", "api_key_name")}
_COUNT_COLUMNS = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "total_tokens",
    "billed_tokens",
)
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def inert_cell(value: object) -> object:
    """The value, with a leading apostrophe where a spreadsheet would read it as a formula."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _row(bucket: dict, group_by: Sequence[str]) -> list[object]:
    values: list[object] = []
    for dimension in group_by:
        if dimension == "day":
            values.append(bucket["day"].isoformat())
        elif dimension == "model":
            values.append(bucket["model"])
        else:
            prefix = bucket.get("api_key__prefix")
            values += [f"sk-{prefix}" if prefix else "", bucket.get("api_key__name") or ""]
    prompt, completion = int(bucket["prompt_tokens"] or 0), int(bucket["completion_tokens"] or 0)
    values += [
        bucket["requests"],
        bucket["errors"],
        prompt,
        completion,
        int(bucket["cached_tokens"] or 0),
        prompt + completion,
        f"{float(bucket.get('billed_tokens') or 0):g}",
    ]
    return [inert_cell(v) for v in values]


def usage_csv(*, tenant_id: int, start: date, end: date, group_by: Sequence[str] = CSV_GROUP_BY) -> str:
    """The tenant's usage between two days (both included) as CSV text, with a header row."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        [c for dimension in group_by for c in _DIMENSION_COLUMNS[dimension]] + list(_COUNT_COLUMNS)
    )
    for bucket in usage_summary(tenant_id=tenant_id, start=start, end=end, group_by=group_by):
        writer.writerow(_row(bucket, group_by))
    return out.getvalue()


def usage_csv_filename(*, tenant_slug: str, start: date, end: date) -> str:
    return f"usage-{tenant_slug}-{start.isoformat()}-{end.isoformat()}.csv"
