"""The audit log as CSV, for the admin's export and the dashboard's download.

Cells a spreadsheet would run as a formula are written with a leading apostrophe (tenants.usage_csv)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable

from django.http import HttpResponse

from tenants.models import AuditEntry
from tenants.usage_csv import inert_cell

COLUMNS = (
    "time",
    "tenant",
    "source",
    "actor",
    "address",
    "action",
    "object_type",
    "object_id",
    "object",
    "changes",
)


def audit_csv(entries: Iterable[AuditEntry]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for e in entries:
        row = [
            e.created_at.isoformat(),
            e.tenant_slug,
            e.source,
            e.actor,
            e.address or "",
            e.action,
            e.object_type,
            e.object_id,
            e.object_repr,
            json.dumps(e.changes, sort_keys=True),
        ]
        writer.writerow([inert_cell(v) for v in row])
    return out.getvalue()


def audit_csv_response(entries: Iterable[AuditEntry], *, filename: str) -> HttpResponse:
    response = HttpResponse(audit_csv(entries), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response
