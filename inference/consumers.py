"""Websocket streaming: `/ws/v1/chat`.

Offer the subprotocol `pagoda.v1` (the server selects it, and refuses a handshake without it, so a
key is never echoed back as the selected subprotocol). Authenticate with a tenant API key, either as
a second subprotocol `pagoda.bearer.<key>` or in the first message `{"type": "auth", "api_key": ...}`
within WEBSOCKET_AUTH_TIMEOUT seconds (the socket is closed otherwise). The key is checked again
when each stream starts, as a REST call checks it: a key revoked or expired, or a tenant
deactivated, stops starting streams at once. Then, up to MAX_STREAMS_PER_CONNECTION concurrent
streams, each with its id:

  -> {"type": "chat", "id": "<client id>", "request": {...chat completions body...}}
  <- {"type": "delta", "id", "index", "content", "logprobs"?}
  <- {"type": "delta", "id", "index", "tool_calls": [...]}   (with tools: as in SSE chunks)
  <- {"type": "done", "id", "usage", "finish_reason", "choices": [{"index", "finish_reason"}]}
  <- {"type": "error", "id", "error": {"message", "type", "param", "code"}}
  -> {"type": "cancel", "id"}     <- {"type": "cancelled", "id", "usage"}  (usage zero when the
                                       stream was cancelled before it was admitted)

Admission, settlement and the ledger are those of the REST API (the same Generation).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from core.api.exceptions import refusal_held, to_platform_error
from core.concurrency import blocking
from core.errors import AuthenticationError, InvalidRequestError, PlatformError
from core.request_ids import new_request_id
from inference import metrics
from inference.api.base import generation_input
from inference.api.chat_completions.messages import ChoiceMessageStream
from inference.api.chat_completions.render import chat_logprobs
from inference.api.chat_completions.schema import ChatCompletionInputSerializer
from inference.api.formatting import usage_body
from inference.services import ChoiceDelta, ChoiceFinished, GenerationUsage, generation_start
from tenants.services import api_key_authenticate, request_admit
from tenants.types import AuthContext

logger = logging.getLogger(__name__)

SUBPROTOCOL = "pagoda.v1"
BEARER_SUBPROTOCOL_PREFIX = "pagoda.bearer."
MAX_STREAMS_PER_CONNECTION = 16
CLOSE_UNAUTHENTICATED = 4401
CLOSE_PROTOCOL = 4400
# Messages up to this size are parsed on the event loop (a thread hop costs more than parsing them).
INLINE_PARSE_MAX = 16 * 1024


def _message_parse(raw: str | bytes) -> dict[str, Any]:
    try:
        content = json.loads(raw)
    # RecursionError: nesting deeper than the parser's stack is bad input, not a crash.
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequestError("Messages must be JSON objects.", code="invalid_json") from exc
    if not isinstance(content, dict):
        raise InvalidRequestError("Messages must be JSON objects.")
    return content


class ChatConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.auth: AuthContext | None = None
        self.raw_key: str | None = None
        self.streams: dict[str, asyncio.Task] = {}
        self.auth_deadline: asyncio.TimerHandle | None = None
        offered = list(self.scope.get("subprotocols") or [])
        if SUBPROTOCOL not in offered:
            # Selecting anything else could echo a `pagoda.bearer.<key>` back in the handshake.
            await self.close(code=CLOSE_PROTOCOL)
            return
        await self.accept(SUBPROTOCOL)
        bearer = next((p for p in offered if p.startswith(BEARER_SUBPROTOCOL_PREFIX)), None)
        if bearer is not None:
            await self._authenticate(bearer[len(BEARER_SUBPROTOCOL_PREFIX) :])
        else:
            timeout = settings.WEBSOCKET_AUTH_TIMEOUT
            self.auth_deadline = asyncio.get_running_loop().call_later(
                timeout, lambda: asyncio.ensure_future(self._auth_timed_out())
            )

    async def _auth_timed_out(self) -> None:
        if self.auth is None:
            await self._error(None, AuthenticationError("No API key was sent in time."))
            await self.close(code=CLOSE_UNAUTHENTICATED)

    async def disconnect(self, code: int) -> None:
        if self.auth_deadline is not None:
            self.auth_deadline.cancel()
        tasks = list(self.streams.values())
        for task in tasks:
            task.cancel()
        # Each generation settles in its own finally; wait for that before the consumer goes.
        await asyncio.gather(*tasks, return_exceptions=True)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs) -> None:
        raw = text_data or bytes_data or b""
        try:
            # A big message is parsed in a thread: every stream of this process waits while the
            # event loop parses.
            content = (
                _message_parse(raw) if len(raw) <= INLINE_PARSE_MAX else await blocking(_message_parse)(raw)
            )
        except InvalidRequestError as exc:
            # It may have been meant to start a stream: it counts as one, as an HTTP request whose
            # body is not JSON does.
            if self.auth is None or await self._counted(None) is not None:
                await self._error(None, exc)
            return
        await self.receive_json(content)

    async def receive_json(self, content: dict[str, Any], **kwargs) -> None:
        kind = content.get("type")
        if kind == "auth":
            await self._authenticate(content.get("api_key"))
        elif self.auth is None:
            await self._error(
                content.get("id"),
                AuthenticationError('Authenticate first: send {"type": "auth", "api_key": ...}.'),
            )
        elif kind == "chat":
            request_id = await self._counted(content.get("id"))
            if request_id is not None:
                await self._start(content.get("id"), content.get("request"), request_id)
        elif kind == "cancel":
            task = self.streams.get(str(content.get("id")))
            if task is not None:
                task.cancel()
        else:
            await self._error(
                content.get("id"), InvalidRequestError(f"Unknown message type {kind!r}.", param="type")
            )

    async def _authenticate(self, raw_key: Any) -> None:
        try:
            if not isinstance(raw_key, str) or not raw_key:
                raise AuthenticationError("api_key is required.")
            self.auth = await blocking(api_key_authenticate)(raw_key=raw_key)
        except PlatformError as exc:
            await self._error(None, exc)
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.raw_key = raw_key
        if self.auth_deadline is not None:
            self.auth_deadline.cancel()
        await self.send_json({"type": "authenticated"})

    async def _counted(self, stream_id: Any) -> str | None:
        """Count a message that would start a stream against the requests/min limit before
        anything else is done with it, invalid ones included, as the REST API counts each request
        before reading its body: the request id it was counted under, or None (refused, and told)."""
        request_id = new_request_id()
        try:
            await blocking(request_admit)(auth=self.auth, request_id=request_id)
        except PlatformError as exc:
            await self._error(stream_id, exc)
            return None
        return request_id

    async def _start(self, stream_id: Any, body: Any, request_id: str) -> None:
        if not isinstance(stream_id, str) or not stream_id:
            await self._error(None, InvalidRequestError("Each chat message needs a string id.", param="id"))
        elif stream_id in self.streams:
            await self._error(
                stream_id, InvalidRequestError(f"Stream {stream_id!r} is already running.", param="id")
            )
        elif len(self.streams) >= MAX_STREAMS_PER_CONNECTION:
            await self._error(
                stream_id,
                InvalidRequestError(
                    f"At most {MAX_STREAMS_PER_CONNECTION} concurrent streams per connection.", param="id"
                ),
            )
        else:
            self.streams[stream_id] = asyncio.create_task(self._run(stream_id, body, request_id))

    async def _run(self, stream_id: str, body: Any, request_id: str) -> None:
        try:
            await self._generate(stream_id, body, request_id)
        except Exception as exc:
            # Whatever ended the stream (Redis unreachable, a bug in a formatter), its client hears
            # of it: it waits for a `done` or an `error`. The generation settled in its own finally.
            error = to_platform_error(exc)
            if error is None:
                logger.exception("stream %r failed", stream_id)
                error = PlatformError()
            await self._error(stream_id, error)
        finally:
            self.streams.pop(stream_id, None)

    async def _generate(self, stream_id: str, body: Any, request_id: str) -> None:
        started = time.perf_counter()
        try:
            try:
                # As a REST call would be: a key revoked, expired or of a deactivated tenant since
                # the socket authenticated starts nothing more (the cached check costs one Redis read).
                self.auth = await blocking(api_key_authenticate)(raw_key=self.raw_key)
            except PlatformError as exc:
                await self._error(stream_id, exc)
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return
            try:
                # In a thread, as the REST views validate: a big body takes the serializers a while.
                data = await blocking(generation_input)(body, ChatCompletionInputSerializer)
            except PlatformError as exc:
                metrics.record_refused(tenant=self.auth.tenant_slug, model=None, code=exc.code)
                raise
            data["stream"] = False  # the websocket streams by itself; SSE options do not apply
            data.pop("stream_options", None)
            generation, events = await generation_start(
                auth=self.auth,
                kind="chat",
                data=data,
                request_id=request_id,
                started_at=started,
                request_counted=True,  # when the message came in, before its body was read
                streamed=True,
            )
        except PlatformError as exc:
            await self._error(stream_id, exc)
            return
        except asyncio.CancelledError:
            # Cancelled before it was admitted: nothing was reserved, queued or billed.
            await self._send_quietly(
                {"type": "cancelled", "id": stream_id, "usage": usage_body(GenerationUsage())}
            )
            return
        plan = generation.plan
        reasons: dict[int, str] = {}
        tool_streams: dict[int, ChoiceMessageStream] = {}
        try:
            async for item in events:
                if plan.parses_message and isinstance(item, ChoiceDelta | ChoiceFinished):
                    await self._send_tool_deltas(stream_id, plan, item, tool_streams, reasons)
                elif isinstance(item, ChoiceDelta) and (item.text or item.token_ids):
                    message = {"type": "delta", "id": stream_id, "index": item.index, "content": item.text}
                    if plan.logprobs is not None:
                        message["logprobs"] = chat_logprobs(plan, item.logprobs)
                    await self.send_json(message)
                elif isinstance(item, ChoiceFinished):
                    reasons[item.index] = item.finish_reason
        except asyncio.CancelledError:
            # run()'s finally has settled by now; the usage is what the tenant is billed.
            await self._send_quietly(
                {
                    "type": "cancelled",
                    "id": stream_id,
                    "request_id": plan.request_id,
                    "usage": usage_body(generation.usage),
                }
            )
            return
        except PlatformError as exc:
            await self._error(stream_id, exc)
            return
        await self.send_json(
            {
                "type": "done",
                "id": stream_id,
                "request_id": plan.request_id,
                "usage": usage_body(generation.usage),
                "finish_reason": reasons.get(0),
                "choices": [{"index": i, "finish_reason": r} for i, r in sorted(reasons.items())],
                "service_tier": plan.service_tier,
            }
        )

    async def _send_tool_deltas(
        self,
        stream_id: str,
        plan: Any,
        item: ChoiceDelta | ChoiceFinished,
        streams: dict[int, ChoiceMessageStream],
        reasons: dict[int, str],
    ) -> None:
        """A chat with tools or a reasoning parser: reasoning_content, content and tool_calls
        deltas, as the SSE stream's chunks carry them."""
        stream = streams.setdefault(item.index, ChoiceMessageStream(plan))
        if isinstance(item, ChoiceFinished):
            deltas, reasons[item.index] = stream.finish(item.finish_reason)
        else:
            deltas = stream.feed(item.text)
        for delta in deltas:
            await self.send_json({"type": "delta", "id": stream_id, "index": item.index, **delta})

    async def _send_quietly(self, message: dict) -> None:
        try:
            await self.send_json(message)
        except Exception:  # the socket may be gone already (disconnect cancels every stream)
            pass

    async def _error(self, stream_id: Any, exc: PlatformError) -> None:
        # Messages are taken one at a time, so a client sending again at once is refused at most
        # once per hold.
        await refusal_held(exc)
        await self._send_quietly({"type": "error", "id": stream_id, **exc.as_body()})
