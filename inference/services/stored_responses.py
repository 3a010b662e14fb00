"""The Responses API's stored responses: kept per tenant in the database, read back by id, chained
by `previous_response_id`, bounded in bytes per tenant and expired after RESPONSES_TTL_DAYS.

Another tenant's response, a deleted one and an expired one are the same 404: a caller cannot tell
which ids exist elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import orjson
from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from core.errors import InvalidRequestError, NotFoundError
from inference.models import StoredResponse


@dataclass(frozen=True, slots=True)
class ResponseTurn:
    """What a stored response gives the next turn: its id, its conversation as chat messages (the
    earlier turns' included), and where the chain stands."""

    id: str
    root_id: str
    depth: int
    messages: list[dict[str, Any]]


def _not_found(response_id: str, param: str | None = None) -> NotFoundError:
    return NotFoundError(f"No response with id '{response_id}' is stored.", param=param)


def _live(tenant_id: int):
    return StoredResponse.objects.filter(tenant_id=tenant_id, expires_at__gt=timezone.now())


def stored_response_get(*, tenant_id: int, response_id: str) -> StoredResponse:
    """The tenant's stored response; NotFoundError if it has none by that id (or it expired)."""
    row = _live(tenant_id).filter(id=response_id).first()
    if row is None:
        raise _not_found(response_id)
    return row


def stored_response_turn(*, tenant_id: int, response_id: str) -> ResponseTurn:
    """The conversation that `previous_response_id` continues: every turn of the chain ending at
    `response_id`, oldest first, read in one query. A turn of the chain deleted or expired since
    ends the conversation: the client must send the history itself."""
    head = _live(tenant_id).filter(id=response_id).values("id", "root_id", "depth").first()
    if head is None:
        raise _not_found(response_id, "previous_response_id")
    rows = {
        row["id"]: row
        for row in _live(tenant_id)
        .filter(root_id=head["root_id"], depth__lte=head["depth"])
        .values("id", "previous_id", "messages")
    }
    chain: list[dict[str, Any]] = []
    current: str | None = response_id
    while current is not None:
        row = rows.get(current)
        if row is None:
            raise InvalidRequestError(
                f"An earlier response of the conversation that '{response_id}' continues is no longer "
                "stored; send the conversation as input instead.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        chain.append(row)
        current = row["previous_id"]
    messages = [message for row in reversed(chain) for message in row["messages"]]
    return ResponseTurn(id=head["id"], root_id=head["root_id"], depth=head["depth"], messages=messages)


def stored_bytes(*, tenant_id: int) -> int:
    return _live(tenant_id).aggregate(total=Sum("size_bytes"))["total"] or 0


def stored_response_room(*, tenant_id: int) -> None:
    """Refuse a request that asks to be stored while the tenant's stored responses fill its bound
    (checked before anything runs; one response may take the total past it by its own size)."""
    used, limit = stored_bytes(tenant_id=tenant_id), settings.RESPONSES_STORAGE_PER_TENANT
    if used >= limit:
        raise InvalidRequestError(
            f"Your tenant's stored responses take {used} bytes, the most it may keep is {limit}. "
            "Delete some (DELETE /v1/responses/{id}) or send store: false.",
            param="store",
            code="response_storage_quota",
        )


def stored_response_save(
    *,
    tenant_id: int,
    body: dict[str, Any],
    input_items: list[dict[str, Any]],
    messages: list[dict[str, Any]],
    previous: ResponseTurn | None,
) -> StoredResponse:
    """Keep a finished response: its object, the input as sent and this turn's chat messages."""
    size = sum(len(orjson.dumps(part)) for part in (body, input_items, messages))
    created = timezone.now()
    return StoredResponse.objects.create(
        id=body["id"],
        tenant_id=tenant_id,
        previous_id=previous.id if previous else None,
        root_id=previous.root_id if previous else body["id"],
        depth=previous.depth + 1 if previous else 0,
        model=body["model"],
        body=body,
        input_items=input_items,
        messages=messages,
        size_bytes=size,
        created_at=created,
        expires_at=created + timedelta(days=settings.RESPONSES_TTL_DAYS),
    )


def stored_response_delete(*, tenant_id: int, response_id: str) -> None:
    deleted, _ = _live(tenant_id).filter(id=response_id).delete()
    if not deleted:
        raise _not_found(response_id)


def stored_response_input_items(
    *, tenant_id: int, response_id: str, limit: int, order: str, after: str | None
) -> tuple[list[dict[str, Any]], bool]:
    """A page of a stored response's input items (OpenAI's list: `order` asc or desc, the items
    after the one with id `after`), and whether more follow."""
    items = list(stored_response_get(tenant_id=tenant_id, response_id=response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequestError(f"No input item with id '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    return items[:limit], len(items) > limit


def stored_responses_expire() -> int:
    """Delete every stored response past its expiry (readers already ignore them); how many."""
    deleted, _ = StoredResponse.objects.filter(expires_at__lte=timezone.now()).delete()
    return deleted
