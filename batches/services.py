"""Files and batches: upload, delete, create, cancel, and the steps a runner takes a batch through
(validate its input into lines, record each line's outcome, finalize into output and error files).

Every lookup is by tenant: another tenant's file or batch is not found. A file's size, its lines and
a tenant's stored bytes are bounded (BATCH_FILE_MAX_BYTES, BATCH_FILE_MAX_LINES,
BATCH_FILES_MAX_BYTES_PER_TENANT). Counts move with F() updates; a batch's status moves only forward
(`_advance`), so two runners, or a runner and a cancel, never undo each other.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from datetime import timedelta
from typing import IO, Any

from celery import signature
from django.conf import settings
from django.core.files.base import ContentFile
from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from batches.models import Batch, BatchRequest, File
from core.errors import InvalidRequestError, NotFoundError, RequestTooLargeError

# The endpoints a batch may run, and OpenAI's one completion window.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS = ("24h",)
# A line's error when the batch ended before it ran.
EXPIRED_ERROR = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}
CANCELLED_ERROR = {
    "code": "batch_cancelled",
    "message": "This request was not executed: the batch was cancelled.",
}


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


# --- files ----------------------------------------------------------------------------------------


def file_get(*, tenant_id: int, file_id: str) -> File:
    file = File.objects.filter(tenant_id=tenant_id, id=file_id).first()
    if file is None:
        raise NotFoundError(f"No such File object: {file_id}", code="file_not_found", param="file_id")
    return file


def _count_lines(stream: IO[bytes]) -> tuple[int, int]:
    """(bytes, non-blank lines) of an upload, read once in chunks."""
    size = lines = 0
    carry = b""
    for chunk in iter(lambda: stream.read(1 << 20), b""):
        size += len(chunk)
        parts = (carry + chunk).split(b"\n")
        carry = parts.pop()
        lines += sum(1 for part in parts if part.strip())
    if carry.strip():
        lines += 1
    stream.seek(0)
    return size, lines


@transaction.atomic
def file_create(*, tenant_id: int, upload: IO[bytes], filename: str, purpose: str) -> File:
    """Store an uploaded batch input file, within the tenant's bounds (checked under a lock on the
    tenant's files, so two uploads cannot both pass the total)."""
    if purpose != File.Purpose.BATCH:
        raise InvalidRequestError(
            f"purpose must be 'batch' (the files this server keeps are batch inputs), got {purpose!r}.",
            param="purpose",
        )
    size, lines = _count_lines(upload)
    if size > settings.BATCH_FILE_MAX_BYTES:
        raise RequestTooLargeError(
            f"The file is {size} bytes; at most {settings.BATCH_FILE_MAX_BYTES} are accepted.", param="file"
        )
    if lines == 0:
        raise InvalidRequestError(
            "The file is empty: a batch input has one JSON request per line.", param="file"
        )
    if lines > settings.BATCH_FILE_MAX_LINES:
        raise InvalidRequestError(
            f"The file has {lines} lines; a batch input may have at most {settings.BATCH_FILE_MAX_LINES}.",
            param="file",
        )
    from tenants.models import Tenant

    Tenant.objects.select_for_update().filter(id=tenant_id).first()  # serializes the tenant's uploads
    stored = File.objects.filter(tenant_id=tenant_id).aggregate(total=Sum("bytes"))["total"] or 0
    if stored + size > settings.BATCH_FILES_MAX_BYTES_PER_TENANT:
        raise InvalidRequestError(
            f"Storing this file would make your organization's files {stored + size} bytes; the limit "
            f"is {settings.BATCH_FILES_MAX_BYTES_PER_TENANT}. Delete files you no longer need.",
            code="storage_limit_exceeded",
            param="file",
        )
    file = File(
        id=_new_id("file-"),
        tenant_id=tenant_id,
        purpose=purpose,
        filename=(filename or "upload.jsonl")[-255:],
        bytes=size,
        lines=lines,
    )
    file.content.save(f"{file.id}.jsonl", upload, save=False)
    file.save()
    return file


def file_delete(*, tenant_id: int, file_id: str) -> File:
    file = file_get(tenant_id=tenant_id, file_id=file_id)
    with transaction.atomic():
        File.objects.filter(pk=file.pk).delete()
        transaction.on_commit(lambda: file.content.delete(save=False))
    return file


def _output_file(*, tenant_id: int, batch_id: str, kind: str, lines: list[str]) -> str:
    if not lines:
        return ""
    data = ("\n".join(lines) + "\n").encode()
    file = File(
        id=_new_id("file-"),
        tenant_id=tenant_id,
        purpose=File.Purpose.BATCH_OUTPUT,
        filename=f"{batch_id}_{kind}.jsonl",
        bytes=len(data),
        lines=len(lines),
    )
    file.content.save(f"{file.id}.jsonl", ContentFile(data), save=False)
    file.save()
    return file.id


# --- batches --------------------------------------------------------------------------------------


def batch_get(*, tenant_id: int, batch_id: str) -> Batch:
    batch = Batch.objects.filter(tenant_id=tenant_id, id=batch_id).first()
    if batch is None:
        raise NotFoundError(f"No such Batch object: {batch_id}", code="batch_not_found", param="batch_id")
    return batch


def batch_create(
    *,
    tenant_id: int,
    api_key_id: int,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
) -> Batch:
    if endpoint not in ENDPOINTS:
        raise InvalidRequestError(
            f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}.", param="endpoint"
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequestError(
            f"completion_window must be '24h', got {completion_window!r}.", param="completion_window"
        )
    file = file_get(tenant_id=tenant_id, file_id=input_file_id)
    if file.purpose != File.Purpose.BATCH:
        raise InvalidRequestError(
            f"The file {input_file_id} is not a batch input (its purpose is {file.purpose}).",
            param="input_file_id",
        )
    now = timezone.now()
    batch = Batch.objects.create(
        id=_new_id("batch_"),
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        endpoint=endpoint,
        input_file_id=file.id,
        completion_window=completion_window,
        metadata=metadata or None,
        total=0,
        expires_at=now + timedelta(seconds=settings.BATCH_COMPLETION_WINDOW_S),
        created_at=now,
    )
    _schedule_runner(tenant_id)
    return batch


RUN_TASK = "batches.tasks.batch_run"


def _schedule_runner(tenant_id: int) -> None:
    """The tenant's runner, once the caller's transaction commits (the batches-resume beat task
    starts one too, should the broker be away now)."""
    transaction.on_commit(signature(RUN_TASK, args=(tenant_id,)).delay, robust=True)


def _advance(batch_id: str, *, to: str, allowed_from: tuple[str, ...], **fields: Any) -> bool:
    """Move a batch to status `to` when it is in one of `allowed_from`; True when it moved."""
    moved = Batch.objects.filter(id=batch_id, status__in=allowed_from).update(status=to, **fields)
    return bool(moved)


def batch_cancel(*, tenant_id: int, batch_id: str) -> Batch:
    """Stop feeding the batch's lines at once: its runner sees `cancelling`, lets the lines already
    running finish, and ends the batch `cancelled` with what finished."""
    batch = batch_get(tenant_id=tenant_id, batch_id=batch_id)
    _advance(
        batch.id,
        to=Batch.Status.CANCELLING,
        allowed_from=(Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS),
        cancelling_at=timezone.now(),
    )
    _schedule_runner(tenant_id)  # one that is running sees it at its next line
    batch.refresh_from_db()
    return batch


def _lines(file: File) -> Iterator[tuple[int, bytes]]:
    with file.content.open("rb") as stream:
        index = 0
        for raw in stream:
            if raw.strip():
                yield index, raw
                index += 1


def _line_error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def batch_validate(*, batch_id: str, check_body: Any) -> Batch:
    """Read the input file into the batch's lines (once: a batch past validating is left as it is).
    A line that is not a request of the batch's endpoint (bad JSON, no custom_id, another url, a
    duplicate custom_id, a body the endpoint refuses: `check_body(endpoint, body)` raises a
    PlatformError) becomes a failed line with its error; it does not fail the batch. The batch
    fails only when its input file is gone."""
    batch = Batch.objects.get(id=batch_id)
    if batch.status != Batch.Status.VALIDATING:
        return batch
    file = File.objects.filter(tenant_id=batch.tenant_id, id=batch.input_file_id).first()
    if file is None:
        _advance(
            batch.id,
            to=Batch.Status.FAILED,
            allowed_from=(Batch.Status.VALIDATING,),
            failed_at=timezone.now(),
            errors={
                "object": "list",
                "data": [{"code": "file_not_found", "message": "The input file was deleted.", "line": None}],
            },
        )
        return Batch.objects.get(id=batch_id)
    rows: list[BatchRequest] = []
    seen: set[str] = set()
    for index, raw in _lines(file):
        row = BatchRequest(batch_id=batch.id, index=index)
        rows.append(row)
        try:
            line = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            row.status, row.error = (
                BatchRequest.Status.FAILED,
                _line_error("invalid_json", "The line is not JSON."),
            )
            continue
        if not isinstance(line, dict):
            row.status, row.error = (
                BatchRequest.Status.FAILED,
                _line_error("invalid_request", "A line must be an object."),
            )
            continue
        custom_id = line.get("custom_id")
        row.custom_id = custom_id if isinstance(custom_id, str) else None
        problem = _line_problem(line, batch.endpoint, seen)
        if problem is None:
            try:
                check_body(batch.endpoint, line["body"])
            except InvalidRequestError as exc:
                row.response = {"status_code": exc.status_code, "request_id": "", "body": exc.as_body()}
                problem = _line_error(exc.code, exc.message)
        if problem is not None:
            row.status, row.error = BatchRequest.Status.FAILED, problem
            continue
        seen.add(custom_id)
        row.body = line["body"]
    failed = sum(1 for r in rows if r.status == BatchRequest.Status.FAILED)
    with transaction.atomic():
        if not Batch.objects.select_for_update().filter(id=batch.id, status=Batch.Status.VALIDATING).exists():
            return Batch.objects.get(id=batch_id)  # cancelled meanwhile, or another runner did it
        BatchRequest.objects.filter(batch_id=batch.id).delete()
        BatchRequest.objects.bulk_create(rows, batch_size=2000)
        Batch.objects.filter(id=batch.id).update(
            status=Batch.Status.IN_PROGRESS, total=len(rows), failed=failed, in_progress_at=timezone.now()
        )
    return Batch.objects.get(id=batch_id)


def _line_problem(line: dict[str, Any], endpoint: str, seen: set[str]) -> dict[str, str] | None:
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _line_error("missing_custom_id", "Each line needs a custom_id string.")
    if len(custom_id) > 512:
        return _line_error("invalid_custom_id", "A custom_id may be at most 512 characters.")
    if custom_id in seen:
        return _line_error("duplicate_custom_id", f"The custom_id {custom_id!r} is used by an earlier line.")
    if line.get("method") != "POST":
        return _line_error("invalid_method", "The method of a batch line must be POST.")
    if line.get("url") != endpoint:
        return _line_error(
            "mismatched_url", f"The line's url is {line.get('url')!r}; this batch's endpoint is {endpoint}."
        )
    if not isinstance(line.get("body"), dict):
        return _line_error("invalid_body", "The line's body must be a JSON object.")
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        return _line_error("invalid_request", f"Unrecognized field in the line: {unknown[0]}.")
    return None


def batch_line_attempt(*, line_id: int) -> int:
    """The next attempt of a line, counted before it is submitted (so that a crash after the
    submission leaves the attempt on record for the next runner to find)."""
    BatchRequest.objects.filter(id=line_id).update(attempt=F("attempt") + 1)
    return BatchRequest.objects.values_list("attempt", flat=True).get(id=line_id)


def batch_line_finish(*, line_id: int, response: dict[str, Any] | None, error: dict[str, Any] | None) -> None:
    """Record a line's outcome once (a line already finished is left as it is): a response of
    status 200 succeeds; any other, or an error without a response, fails."""
    ok = response is not None and response.get("status_code") == 200
    status = BatchRequest.Status.SUCCEEDED if ok else BatchRequest.Status.FAILED
    with transaction.atomic():
        moved = BatchRequest.objects.filter(id=line_id, status=BatchRequest.Status.PENDING).update(
            status=status, response=response, error=error
        )
        if moved:
            batch_id = BatchRequest.objects.values_list("batch_id", flat=True).get(id=line_id)
            counter = "completed" if ok else "failed"
            Batch.objects.filter(id=batch_id).update(**{counter: F(counter) + 1})


def batch_finalize(*, batch_id: str) -> Batch:
    """Write the output file (the lines that succeeded, in input order) and the error file (the
    others; lines that never ran say why: the window expired, or the batch was cancelled), and end
    the batch: completed, expired (past its window) or cancelled."""
    batch = Batch.objects.get(id=batch_id)
    if batch.status not in (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING, Batch.Status.FINALIZING):
        return batch
    now = timezone.now()
    cancelled = batch.status == Batch.Status.CANCELLING or batch.cancelling_at is not None
    end = (
        Batch.Status.CANCELLED
        if cancelled
        else (Batch.Status.EXPIRED if now >= batch.expires_at else Batch.Status.COMPLETED)
    )
    _advance(
        batch.id,
        to=Batch.Status.FINALIZING if not cancelled else Batch.Status.CANCELLING,
        allowed_from=(Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING, Batch.Status.CANCELLING),
        finalizing_at=now,
    )
    unrun = CANCELLED_ERROR if cancelled else EXPIRED_ERROR
    outputs: list[str] = []
    errors: list[str] = []
    not_run = 0
    for row in BatchRequest.objects.filter(batch_id=batch.id).order_by("index").iterator(chunk_size=500):
        line = {"id": f"batch_req_{batch.id.removeprefix('batch_')}_{row.index}", "custom_id": row.custom_id}
        if row.status == BatchRequest.Status.SUCCEEDED:
            outputs.append(json.dumps({**line, "response": row.response, "error": None}))
        elif row.status == BatchRequest.Status.FAILED:
            errors.append(json.dumps({**line, "response": row.response, "error": row.error}))
        else:
            not_run += 1
            errors.append(json.dumps({**line, "response": None, "error": unrun}))
    with transaction.atomic():
        output_id = _output_file(tenant_id=batch.tenant_id, batch_id=batch.id, kind="output", lines=outputs)
        error_id = _output_file(tenant_id=batch.tenant_id, batch_id=batch.id, kind="error", lines=errors)
        stamp = {
            Batch.Status.COMPLETED: "completed_at",
            Batch.Status.EXPIRED: "expired_at",
            Batch.Status.CANCELLED: "cancelled_at",
        }[end]
        BatchRequest.objects.filter(batch_id=batch.id, status=BatchRequest.Status.PENDING).update(
            status=BatchRequest.Status.FAILED, error=unrun
        )
        Batch.objects.filter(id=batch.id).update(
            status=end,
            output_file_id=output_id,
            error_file_id=error_id,
            failed=F("failed") + not_run,
            **{stamp: timezone.now()},
        )
    return Batch.objects.get(id=batch_id)
