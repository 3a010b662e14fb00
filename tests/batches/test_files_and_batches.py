"""/v1/files and /v1/batches without engines: uploads within their bounds, what a tenant sees of
another's (nothing: 404), a batch's creation refused for a bad endpoint or window, the input read
into lines (bad ones failed with their errors, the batch not failed), cancel before it runs, and
the output and error files a finalized batch gets."""

from __future__ import annotations

import io
import json

import pytest
from django.test import Client

from batches import services
from batches.lines import check_body
from batches.models import Batch, BatchRequest, File
from tests.helpers import logged_in

pytestmark = pytest.mark.django_db(transaction=True)  # the upload view reads in a thread of its own


@pytest.fixture(autouse=True)
def _media(settings, tmp_path) -> None:
    settings.MEDIA_ROOT = tmp_path / "media"


def _upload(
    world, content: bytes, *, raw_key: str | None = None, purpose: str = "batch", name: str = "in.jsonl"
):
    upload = io.BytesIO(content)
    upload.name = name
    return Client().post("/v1/files", {"file": upload, "purpose": purpose}, headers=world.headers(raw_key))


def _line(world, custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": world.model, "messages": [{"role": "user", "content": "hi"}], **body},
    }


def _batch(world, file_id: str) -> Batch:
    return services.batch_create(
        tenant_id=world.tenant_a.id,
        api_key_id=world.key_a.id,
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=None,
    )


def _jsonl(*lines) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def test_a_file_is_uploaded_listed_read_and_deleted_by_its_tenant_only(world) -> None:
    content = _jsonl(_line(world, "a"), _line(world, "b"))
    created = _upload(world, content)
    assert created.status_code == 200, created.content
    body = created.json()
    assert (body["object"], body["purpose"], body["bytes"], body["filename"]) == (
        "file",
        "batch",
        len(content),
        "in.jsonl",
    )
    file_id = body["id"]
    assert File.objects.get(id=file_id).lines == 2
    client = Client()
    assert client.get(f"/v1/files/{file_id}", headers=world.headers()).json()["id"] == file_id
    assert (
        b"".join(client.get(f"/v1/files/{file_id}/content", headers=world.headers()).streaming_content)
        == content
    )
    assert [f["id"] for f in client.get("/v1/files", headers=world.headers()).json()["data"]] == [file_id]
    other = world.headers(world.raw_key_b)
    for response in (
        client.get(f"/v1/files/{file_id}", headers=other),
        client.get(f"/v1/files/{file_id}/content", headers=other),
        client.delete(f"/v1/files/{file_id}", headers=other),
    ):
        assert response.status_code == 404 and response.json()["error"]["code"] == "file_not_found"
    assert client.get("/v1/files", headers=other).json()["data"] == []
    deleted = client.delete(f"/v1/files/{file_id}", headers=world.headers())
    assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
    assert not File.objects.exists()


def test_uploads_are_bounded_per_file_per_line_count_and_per_tenant(world, settings) -> None:
    settings.BATCH_FILE_MAX_BYTES = 300
    settings.BATCH_FILE_MAX_LINES = 3
    settings.BATCH_FILES_MAX_BYTES_PER_TENANT = 400
    big = _upload(world, b"x" * 301)
    assert big.status_code == 413 and "at most 300" in big.json()["error"]["message"]
    many = _upload(world, b"{}\n" * 4)
    assert many.status_code == 400 and "at most 3" in many.json()["error"]["message"]
    empty = _upload(world, b"\n  \n")
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    purpose = _upload(world, b"{}\n", purpose="fine-tune")
    assert purpose.status_code == 400 and purpose.json()["error"]["param"] == "purpose"
    assert _upload(world, b"x" * 250).status_code == 200
    over = _upload(world, b"x" * 200)
    assert over.status_code == 400 and over.json()["error"]["code"] == "storage_limit_exceeded"
    assert _upload(world, b"x" * 200, raw_key=world.raw_key_b).status_code == 200  # B's own bound
    assert File.objects.count() == 2


def test_a_batch_needs_an_endpoint_a_window_and_the_callers_own_input_file(world) -> None:
    file_id = _upload(world, _jsonl(_line(world, "a"))).json()["id"]
    client = Client()

    def create(raw_key=None, **body):
        body = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **body,
        }
        return client.post(
            "/v1/batches", json.dumps(body), content_type="application/json", headers=world.headers(raw_key)
        )

    assert create(endpoint="/v1/responses").json()["error"]["param"] == "endpoint"
    assert create(completion_window="1h").json()["error"]["param"] == "completion_window"
    assert create(metadata={f"k{i}": "v" for i in range(17)}).json()["error"]["param"] == "metadata"
    assert create(raw_key=world.raw_key_b).status_code == 404
    assert not Batch.objects.exists()
    batch = create(metadata={"job": "nightly"}).json()
    assert (batch["object"], batch["status"], batch["input_file_id"]) == ("batch", "validating", file_id)
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert client.get(f"/v1/batches/{batch['id']}", headers=world.headers(world.raw_key_b)).status_code == 404
    page = client.get("/v1/batches?limit=1", headers=world.headers()).json()
    assert [b["id"] for b in page["data"]] == [batch["id"]] and page["has_more"] is False


def test_the_input_is_read_into_lines_and_bad_ones_fail_alone(world) -> None:
    content = _jsonl(
        _line(world, "good", max_tokens=4),
        b"{oops",
        {**_line(world, "url"), "url": "/v1/embeddings"},
        _line(world, "negative", max_tokens=-1),
        _line(world, "good"),
        _line(world, "stream", stream=True),
        {**_line(world, "extra"), "priority": 1},
    )
    file_id = _upload(world, content).json()["id"]
    batch = _batch(world, file_id)
    batch = services.batch_validate(batch_id=batch.id, check_body=check_body)
    assert (batch.status, batch.total, batch.failed, batch.completed) == ("in_progress", 7, 6, 0)
    rows = {row.index: row for row in BatchRequest.objects.filter(batch=batch)}
    assert rows[0].status == "pending" and rows[0].body["max_tokens"] == 4
    assert rows[1].error["code"] == "invalid_json" and rows[1].custom_id is None
    assert rows[2].error["code"] == "mismatched_url"
    assert (
        rows[3].response["status_code"] == 400 and rows[3].response["body"]["error"]["param"] == "max_tokens"
    )
    assert rows[4].error["code"] == "duplicate_custom_id"
    assert rows[5].response["body"]["error"]["param"] == "stream"
    assert rows[6].error["code"] == "invalid_request"
    # Validated once: a second run (a resumed runner) leaves the lines as they are.
    assert services.batch_validate(batch_id=batch.id, check_body=check_body).total == 7
    assert BatchRequest.objects.filter(batch=batch).count() == 7


def test_a_batch_cancelled_before_it_ran_ends_cancelled_with_every_line_in_the_error_file(world) -> None:
    file_id = _upload(world, _jsonl(_line(world, "a"), _line(world, "b"))).json()["id"]
    batch = _batch(world, file_id)
    services.batch_validate(batch_id=batch.id, check_body=check_body)
    cancelled = Client().post(f"/v1/batches/{batch.id}/cancel", headers=world.headers()).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    batch = services.batch_finalize(batch_id=batch.id)
    assert (batch.status, batch.completed, batch.failed, batch.output_file_id) == ("cancelled", 0, 2, "")
    error_file = File.objects.get(id=batch.error_file_id)
    assert error_file.purpose == "batch_output" and error_file.tenant_id == world.tenant_a.id
    lines = [json.loads(line) for line in error_file.content.open("rb").read().splitlines()]
    assert [(row["custom_id"], row["error"]["code"]) for row in lines] == [
        ("a", "batch_cancelled"),
        ("b", "batch_cancelled"),
    ]
    # A finished batch is not cancelled again, and finalizing twice writes nothing new.
    assert services.batch_finalize(batch_id=batch.id).error_file_id == error_file.id
    assert (
        Client().post(f"/v1/batches/{batch.id}/cancel", headers=world.headers()).json()["status"]
        == "cancelled"
    )


def test_a_batch_whose_input_file_was_deleted_fails(world) -> None:
    file_id = _upload(world, _jsonl(_line(world, "a"))).json()["id"]
    batch = _batch(world, file_id)
    services.file_delete(tenant_id=world.tenant_a.id, file_id=file_id)
    batch = services.batch_validate(batch_id=batch.id, check_body=check_body)
    assert batch.status == "failed" and batch.errors["data"][0]["code"] == "file_not_found"


def test_the_dashboard_shows_a_tenants_batches_and_their_files_to_its_members_only(world) -> None:
    file_id = _upload(world, _jsonl(_line(world, "a"), _line(world, "b"))).json()["id"]
    batch = _batch(world, file_id)
    services.batch_validate(batch_id=batch.id, check_body=check_body)
    page = f"/dashboard/t/{world.tenant_a.slug}/batches/"
    member, owner, outsider = logged_in(world.member_a), logged_in(world.owner_a), logged_in(world.outsider_b)
    shown = member.get(page).content.decode()
    assert f'data-batch="{batch.id}"' in shown and "0 / 2" in shown and "cancel-batch" not in shown
    download = member.get(f"/dashboard/t/{world.tenant_a.slug}/files/{file_id}/")
    assert download.status_code == 200 and b"".join(download.streaming_content).count(b"custom_id") == 2
    assert member.post(f"/dashboard/t/{world.tenant_a.slug}/batches/{batch.id}/cancel/").status_code == 403
    assert outsider.get(page).status_code == 404
    own = f"/dashboard/t/{world.tenant_b.slug}"
    assert outsider.get(f"{own}/files/{file_id}/").status_code == 404
    assert outsider.post(f"{own}/batches/{batch.id}/cancel/").status_code == 404
    assert batch.id not in outsider.get(f"{own}/batches/").content.decode()
    assert "cancel-batch" in owner.get(page).content.decode()
    cancelled = owner.post(f"/dashboard/t/{world.tenant_a.slug}/batches/{batch.id}/cancel/")
    assert cancelled.status_code == 302
    assert Batch.objects.get(id=batch.id).status == Batch.Status.CANCELLING
