"""POST /v1/responses (OpenAI's Responses API), and its stored responses: GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items.

The body is read into the chat completion it amounts to (inference.api.openai_responses.translate),
after the conversation that `previous_response_id` continues, checked by the chat serializer and
run by the one generation service: the same limits, tiers, fair share and ledger as
/v1/chat/completions. A response asked to be stored (`store`, true by default) is written to the
database before its last event is sent, so the client's next turn finds it on any web process."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema

from core.api.base import ApiView, json_body
from core.api.openapi import api_errors
from core.concurrency import blocking
from core.errors import InvalidRequestError, PlatformError
from inference.api.base import CountedRefusalsApi, generation_input
from inference.api.body_json import body_json
from inference.api.chat_completions.schema import ChatCompletionInputSerializer
from inference.api.openai_responses import render, translate
from inference.api.openai_responses.schema import (
    RESPONSE_EVENTS,
    InputItemListSerializer,
    ResponseCreateInputSerializer,
    ResponseDeletedSerializer,
    ResponseObjectSerializer,
)
from inference.services import ChoiceDelta, ChoiceFinished, Generation, collect_choices
from inference.services.stored_responses import (
    ResponseTurn,
    stored_response_delete,
    stored_response_get,
    stored_response_input_items,
    stored_response_room,
    stored_response_save,
    stored_response_turn,
)

logger = logging.getLogger(__name__)

# Chat fields named in a refusal, as the Responses API names them.
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


@dataclass
class _Prepared:
    read: translate.ResponseInput
    data: dict[str, Any]
    previous: ResponseTurn | None


def _prepare(request: HttpRequest, tenant_id: int) -> _Prepared:
    """The body read, the conversation it continues loaded, the storage bound checked, the chat
    body validated (in a thread: it reads the database and may parse megabytes)."""
    body = json_body(request)
    read = translate.response_input(body)
    if body.get("top_logprobs"):
        raise InvalidRequestError("top_logprobs is not supported on this endpoint.", param="top_logprobs")
    previous = None
    if read.previous_response_id is not None:
        previous = stored_response_turn(tenant_id=tenant_id, response_id=read.previous_response_id)
    if read.store:
        stored_response_room(tenant_id=tenant_id)
    chat = {
        **read.chat,
        "messages": translate.chat_messages(
            read, previous.messages if previous else [], read.echo.get("instructions")
        ),
    }
    try:
        data = generation_input(chat, ChatCompletionInputSerializer)
    except InvalidRequestError as exc:
        if exc.param in _PARAMS:
            exc.param = _PARAMS[exc.param]
        raise
    # max_output_tokens is a bound on the answer: cut to the context the prompt leaves.
    data["max_tokens_within_context"] = True
    return _Prepared(read=read, data=data, previous=previous)


def _store(tenant_id: int, prepared: _Prepared, body: dict[str, Any]) -> None:
    stored_response_save(
        tenant_id=tenant_id,
        body=body,
        input_items=prepared.read.items,
        messages=[*prepared.read.turn_messages, render.assistant_message(body["output"])],
        previous=prepared.previous,
    )


def _object(generation: Generation, prepared: _Prepared, status: str, output: list, **kwargs: Any) -> dict:
    return render.response_object(
        generation.plan,
        prepared.read.echo,
        status=status,
        output=output,
        store=prepared.read.store,
        previous_response_id=prepared.read.previous_response_id,
        **kwargs,
    )


async def response_events(
    generation: Generation, events: AsyncIterator, prepared: _Prepared, tenant_id: int
) -> AsyncIterator[bytes]:
    """The Responses event stream, numbered: created, in_progress, the output items' events,
    then completed or incomplete (after the response is stored); on a failure, error and failed."""
    plan = generation.plan
    stream = render.ResponseStream(plan)
    numbers = itertools.count()

    def frame(name: str, body: dict[str, Any]) -> bytes:
        data = orjson.dumps({"type": name, "sequence_number": next(numbers), **body})
        return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"

    try:
        opening = _object(generation, prepared, "in_progress", [], usage=None)
        yield frame("response.created", {"response": opening})
        yield frame("response.in_progress", {"response": opening})
        async for item in events:
            if isinstance(item, ChoiceDelta) and not item.text:
                continue
            if isinstance(item, ChoiceDelta | ChoiceFinished):
                for name, body in stream.feed(item):
                    yield frame(name, body)
        for name, body in stream.close():
            yield frame(name, body)
        status = render.status_of(stream.finish_reason)
        final = _object(generation, prepared, status, stream.output, usage=generation.usage)
        if prepared.read.store:
            await blocking(_store)(tenant_id, prepared, final)
        yield frame(f"response.{status}", {"response": final})
    except Exception as exc:
        if isinstance(exc, PlatformError):
            error = exc
        else:
            logger.exception("stream %s failed", plan.request_id)
            error = PlatformError()
        yield frame("error", {"code": error.code, "message": error.message, "param": error.param})
        failed = _object(
            generation,
            prepared,
            "failed",
            stream.output,
            usage=generation.usage,
            error={"code": error.code, "message": error.message},
        )
        yield frame("response.failed", {"response": failed})


class ResponseCreateApi(CountedRefusalsApi):
    @extend_schema(
        operation_id="createResponse",
        summary="Create a model response (OpenAI's Responses API)",
        request=ResponseCreateInputSerializer,
        responses={
            (200, "application/json"): ResponseObjectSerializer,
            (200, "text/event-stream"): RESPONSE_EVENTS,
            **api_errors(400, 404, 413),
        },
    )
    async def post(self, request: HttpRequest) -> HttpResponse:
        tenant_id = self.auth.tenant_id
        generation, events, prepared = await self.start_generation(
            request,
            kind="chat",
            read=functools.partial(_prepare, tenant_id=tenant_id),
            data_of=lambda prepared: prepared.data,
        )
        if generation.plan.stream:
            response = StreamingHttpResponse(
                response_events(generation, events, prepared, tenant_id), content_type="text/event-stream"
            )
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"
            return response
        choices = await collect_choices(events, count=1)
        output, status = render.whole_output(generation.plan, choices[0].text, choices[0].finish_reason)
        body = _object(generation, prepared, status, output, usage=generation.usage)
        if prepared.read.store:
            await blocking(_store)(tenant_id, prepared, body)
        return HttpResponse(body_json(body), content_type="application/json")


class ResponseDetailApi(ApiView):
    @extend_schema(
        operation_id="getResponse",
        summary="Retrieve a stored response",
        responses={200: ResponseObjectSerializer, **api_errors(404)},
    )
    def get(self, request: HttpRequest, response_id: str) -> dict[str, Any]:
        return stored_response_get(tenant_id=self.auth.tenant_id, response_id=response_id).body

    @extend_schema(
        operation_id="deleteResponse",
        summary="Delete a stored response",
        responses={200: ResponseDeletedSerializer, **api_errors(404)},
    )
    def delete(self, request: HttpRequest, response_id: str) -> dict[str, Any]:
        stored_response_delete(tenant_id=self.auth.tenant_id, response_id=response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _limit(value: str | None) -> int:
    try:
        limit = int(value) if value is not None else 20
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequestError("limit must be an integer from 1 to 100.", param="limit")
    return limit


class ResponseInputItemsApi(ApiView):
    @extend_schema(
        operation_id="listInputItems",
        summary="List a stored response's input items",
        parameters=[
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": 100},
                description="1 to 100 (default 20).",
            ),
            OpenApiParameter("order", str, enum=["asc", "desc"], description="desc (default) or asc."),
            OpenApiParameter("after", str, description="An item id: the page starts after it."),
        ],
        responses={200: InputItemListSerializer, **api_errors(400, 404)},
    )
    def get(self, request: HttpRequest, response_id: str) -> dict[str, Any]:
        order = request.GET.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order must be asc or desc.", param="order")
        items, more = stored_response_input_items(
            tenant_id=self.auth.tenant_id,
            response_id=response_id,
            limit=_limit(request.GET.get("limit")),
            order=order,
            after=request.GET.get("after"),
        )
        return {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": more,
        }
