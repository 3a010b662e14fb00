"""One admitted generation, from reservation to ledger row.

`generation_start()` is how every transport (the REST views, the websocket) starts one: it plans
the request, admits and queues it, and hands back the Generation with its remaining events.

`Generation.run()` is an async generator: it checks that an engine serves the model, reserves the
tokens (raising before anything is queued), queues one engine request per prompt, yields `None`
once queued, then the choices' deltas and finishes as they arrive. Whatever ends it (finished,
client gone, engine failure) its `finally` signals an abort for unfinished engine requests,
settles the reservation to the tokens actually produced and writes the one ledger row, shielded
from a second cancellation. While Redis is unreachable that bookkeeping waits for it; while
PostgreSQL is, the settlement waits in Redis for its ledger row (tenants.services.settlements). If
this process dies first, a settler bills the request from the engines' records
(inference.services.settler): the reservation names this process as its owner.

A stream rides out a short Redis outage: the shared reader reads on from where it was once Redis is
back, and the stream fails (cleanly, billed for what was sent) only after REDIS_OUTAGE_GRACE_S, or
when entries the engine wrote were lost with Redis's last writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from core.concurrency import blocking
from core.errors import InvalidRequestError, PlatformError, RateLimitError, ServiceUnavailableError
from core.redis_client import REDIS_CONNECTION_ERRORS
from engine.protocol import ErrorCode, Event, FinishReason, GenerateRequest, usage_key
from inference import metrics
from inference.gateway import (
    EngineGateway,
    get_gateway,
    live_replica_set_async,
)
from inference.gateway.queue_bounds import queue_place_release, queue_place_take
from inference.gateway.routing import RouteHint, ready_replica_ids_for_admission
from inference.services.logprob_bounds import prompt_logprob_volume_check
from inference.services.plans import (
    GenerationPlan,
    chat_plan_create,
    completion_plan_create,
    embedding_plan_create,
)
from inference.services.settler import OWNER_ID, owner_ensure_beating
from tenants.services import admission_reserve, request_admit, settlement_close
from tenants.types import AuthContext, LedgerEntry, Reservation, Settlement

logger = logging.getLogger(__name__)

# How long one blocking read waits before the replica serving the request is checked for life.
POLL_MS = 500
# Releases of reservations whose request was cancelled during admission, held until they are done.
_UNQUEUED_RELEASES: set[asyncio.Future] = set()
# What each engine error code is to the client: its own request's fault (a 400, billed what was
# computed), a request dropped unstarted (a 503, nothing billed), or the platform's failure (a 500
# naming the code). Every ErrorCode has an entry (a test checks it); a code this process does not
# know (a newer engine's) is the platform's failure.
_CLIENT, _DROPPED, _SERVER = "client", "dropped", "server"
ENGINE_ERROR_KINDS: dict[ErrorCode, str] = {
    ErrorCode.INVALID_REQUEST: _CLIENT,
    ErrorCode.REQUEST_TOO_LARGE: _CLIENT,
    # The sender's grammar: its masks cost too much per token, or it compiled past the timeout.
    ErrorCode.GRAMMAR_TOO_COSTLY: _CLIENT,
    ErrorCode.GRAMMAR_COMPILE_TIMEOUT: _CLIENT,
    ErrorCode.QUEUE_TIMEOUT: _DROPPED,
    ErrorCode.ENGINE_ERROR: _SERVER,
    ErrorCode.LORA_UNAVAILABLE: _SERVER,
    ErrorCode.LORA_LOAD_FAILED: _SERVER,
    ErrorCode.ENGINE_FAILED: _SERVER,
    ErrorCode.ENGINE_SHUTDOWN: _SERVER,
}
# How each way a choice can end reaches the client: a finish_reason it is given, or None where the
# request fails instead (its error event says why).
FINISH_REASONS: dict[FinishReason, str | None] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: None,
    FinishReason.ERROR: None,
}
# How long a running stream waits for an unreachable Redis before it fails.
REDIS_OUTAGE_GRACE_S = 30.0
# Longest wait between two tries of the end-of-request bookkeeping while Redis is unreachable.
FINISH_RETRY_MAX_S = 5.0


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class ChoiceFinished:
    index: int
    finish_reason: str  # stop | length
    # What stopped it: the stop string or stop token id it met; None for EOS or a length.
    stop_reason: int | str | None = None
    embedding: str | None = None  # an embedding's vector: base64 of little-endian float32


@dataclass(slots=True)
class PromptLogprobs:
    prompt: int  # which prompt of the request (its choices are prompt * n .. prompt * n + n - 1)
    entries: list[dict[str, Any] | None]  # one per prompt token, None for the first


@dataclass(slots=True)
class GenerationUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class ReadyRead:
    """A read of `model`'s ready replicas (ready_replica_ids_for_admission) under way."""

    model: str
    replica_ids: asyncio.Future[list[str]]

    @classmethod
    def start(cls, model: str) -> ReadyRead:
        replica_ids = asyncio.ensure_future(ready_replica_ids_for_admission(model))
        # Its error, if nobody awaits it (a request refused as it is planned), is not logged.
        replica_ids.add_done_callback(lambda f: f.cancelled() or f.exception())
        return cls(model, replica_ids)

    def cancel(self) -> None:
        self.replica_ids.cancel()


def engine_unavailable(model: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"No engine is serving the model `{model}` right now. Please retry shortly.",
        code="engine_unavailable",
    )


def dropped_unstarted() -> ServiceUnavailableError:
    return ServiceUnavailableError(
        "The request waited to start longer than its timeout allowed and was dropped; nothing "
        "was billed. Retry later, or with a longer timeout.",
        code=ErrorCode.QUEUE_TIMEOUT,
    )


def _engine_error(event: Event) -> PlatformError:
    message = event.message or "The engine failed while generating."
    kind = ENGINE_ERROR_KINDS.get(event.code)  # type: ignore[call-overload]  # str keys: StrEnum
    if kind == _DROPPED:
        return dropped_unstarted()
    if kind == _CLIENT:
        return InvalidRequestError(message, code=event.code)
    return PlatformError(message, code=event.code or ErrorCode.ENGINE_ERROR)


@dataclass
class Generation:
    auth: AuthContext
    plan: GenerationPlan
    started_at: float = field(default_factory=time.perf_counter)
    arrived_at: float = field(default_factory=time.time)  # unix time: a timeout counts from it
    gateway: EngineGateway = field(default_factory=get_gateway)
    reservation: Reservation | None = None
    request_counted: bool = False  # by request_admit, before planning: admission counts tokens only
    # Seconds the request may wait to start (the client's timeout); the tenant's default also applies.
    client_timeout_s: float | None = None
    # Its reader answers once, with the whole output (a JSON body, a batch line): the replicas
    # publish its first tokens at once and the rest together (GenerateRequest.stream).
    quiet: bool = False
    usage: GenerationUsage = field(init=False)
    status: str = "error"
    error_code: str | None = None
    _pending: set[str] = field(default_factory=set)
    _replicas: dict[str, str] = field(default_factory=dict)
    _engine_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    _produced: int = 0
    _first_token_at: float | None = None
    _last_token_at: float | None = None
    _gaps: list[float] = field(default_factory=list)
    _queued: set[str] = field(default_factory=set)  # engine requests holding a place in the queue bounds
    _releasing: set[asyncio.Future] = field(default_factory=set)  # places being given back
    _redis_lost_at: float | None = None  # monotonic: when this stream last found Redis unreachable
    # Failover: engine requests whose replica was found gone (monotonic time), waiting for another
    # to take them over; and those taken over, with when their last delta before it came.
    _orphaned_at: dict[str, float] = field(default_factory=dict)
    _taken_over: dict[str, float] = field(default_factory=dict)
    _last_delta_at: dict[str, float] = field(default_factory=dict)
    failovers: int = 0
    # Unix time until which the request waits, queued, for a replica to start (plan.replica_wait_s),
    # when none was ready at its admission; and whether it ended waiting, with nothing computed.
    _replica_wait_until: float | None = None
    _never_started: bool = False
    # A Batch API line: its batch (in the ledger, billed at BATCH_PRICE_FACTOR), and its engine
    # requests are queued at most once (EngineGateway.submit(once=True)).
    batch_id: str = ""
    # Admission's read of the model's ready replicas, started while the request was planned.
    ready_read: ReadyRead | None = None

    def __post_init__(self) -> None:
        self.usage = GenerationUsage(prompt_tokens=self.plan.prompt_tokens)

    @property
    def ledger_entry(self) -> LedgerEntry:
        plan = self.plan
        return LedgerEntry(
            model=plan.model,
            adapter=plan.adapter,
            end_user=plan.end_user,
            prompt_cache_key=plan.prompt_cache_key,
            service_tier=plan.service_tier,
            batch_id=self.batch_id,
            price_factor=float(settings.BATCH_PRICE_FACTOR) if self.batch_id else 1.0,
        )

    @property
    def ratelimit_headers(self) -> dict[str, str]:
        return dict(self.reservation.ratelimit_headers) if self.reservation else {}

    async def run(self) -> AsyncIterator[ChoiceDelta | ChoiceFinished | None]:
        plan = self.plan
        # Refusals happen before the reservation: nothing is counted, queued or written for them. A
        # replica that is draining finishes what it holds but is no reason to take a new request.
        if not await self._ready_replica_ids():
            if plan.replica_wait_s <= 0:
                raise engine_unavailable(plan.model)
            # Queued for a replica yet to start (an autoscaler wakes the model on its queue): it must
            # start within the wait, or the replicas drop it unstarted and unbilled.
            self._replica_wait_until = time.time() + plan.replica_wait_s
        await self._take_queue_places()
        reserving = asyncio.ensure_future(
            blocking(_reserve_as_owner)(
                auth=self.auth,
                model=plan.model,
                prompt_tokens=plan.prompt_tokens,
                max_tokens=plan.max_completion_tokens,
                request_id=plan.request_id,
                request_counted=self.request_counted,
                ledger=self.ledger_entry,
                owner=OWNER_ID,
                extra={
                    "engine_requests": {
                        rid: len(prompt)
                        for rid, prompt in zip(plan.engine_request_ids, plan.prompts, strict=True)
                    },
                    "bill_completion": not plan.discard_output,
                    # A batch line runs on if this process dies: its next runner reads its output.
                    "keep_running": bool(self.batch_id),
                },
            )
        )
        try:
            # Shielded: the reservation runs on in its thread whatever happens to this task.
            self.reservation = await asyncio.shield(reserving)
        except PlatformError:
            await self._release_queue_places()
            raise
        except asyncio.CancelledError:
            # Cancelled while admission ran: the caller hears of it now; what admission took is
            # given back once it is done, by a task of its own.
            release = asyncio.ensure_future(self._release_unqueued(reserving))
            _UNQUEUED_RELEASES.add(release)
            release.add_done_callback(_UNQUEUED_RELEASES.discard)
            raise
        try:
            await self._submit()
            yield None
            async for item in self._events():
                yield item
            self.status = "success"
        except (asyncio.CancelledError, GeneratorExit):
            self.status = "cancelled"
            raise
        except PlatformError as exc:
            self.status, self.error_code = "error", exc.code
            raise
        except BaseException:
            self.status, self.error_code = "error", "internal_error"
            raise
        finally:
            # A task, so that a second cancellation of this one cannot interrupt the bookkeeping.
            await asyncio.shield(asyncio.ensure_future(self._finish()))

    async def attach(self) -> AsyncIterator[ChoiceDelta | ChoiceFinished | PromptLogprobs]:
        """The events of this plan's engine requests, queued earlier by a process that is gone (a
        batch runner that died), read from their first entry; nothing is reserved, queued or settled
        here: the settler bills that process's reservation from the engines' records. The usage is
        the engines' count."""
        self._pending.update(self.plan.engine_request_ids)
        try:
            async for item in self._events():
                yield item
        finally:
            await self.gateway.forget(self.plan.engine_request_ids)
        self.usage.completion_tokens = sum(u.get("completion_tokens", 0) for u in self._engine_usage.values())
        self.usage.cached_tokens = sum(u.get("cached_tokens", 0) for u in self._engine_usage.values())
        self.status = "success"

    async def _ready_replica_ids(self) -> list[str]:
        """The model's ready replicas: as read while the request was planned, when that read was of
        the model the plan serves (see generation_start), else read now."""
        read, self.ready_read = self.ready_read, None
        if read is not None and read.model == self.plan.model:
            return await read.replica_ids
        return await ready_replica_ids_for_admission(self.plan.model)

    async def _take_queue_places(self) -> None:
        plan, limits = self.plan, self.auth.tenant_limits
        full = await queue_place_take(
            model=plan.model,
            tenant=self.auth.tenant_slug,
            request_ids=plan.engine_request_ids,
            model_max=plan.max_queued,
            tenant_max=limits.max_queued_requests,
        )
        if full is not None:
            whose = (
                "this model's queue" if full.scope == "model" else "your organization's queue for this model"
            )
            raise RateLimitError(
                f"Too many requests are waiting in {whose} ({full.held}). Please retry after "
                f"{full.retry_after_s} seconds.",
                code="queue_full",
                headers={"retry-after": str(full.retry_after_s)},
            )
        self._queued.update(plan.engine_request_ids)

    async def _release_queue_places(self) -> None:
        """The places still held (and any release still under way) given back: the request ends."""
        if self._releasing:
            await asyncio.gather(*self._releasing)
        ids = sorted(self._queued)
        self._queued.clear()
        await self._send_release(ids, started=False)

    def _release_started(self, request_id: str, *, started: bool) -> None:
        """An engine request's first event: its place is given back by a task of its own, so that
        the event (a stream's first token) is not held up by the round trip."""
        self._queued.discard(request_id)
        task = asyncio.ensure_future(self._send_release([request_id], started=started))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _send_release(self, request_ids: list[str], *, started: bool) -> None:
        if not request_ids:
            return
        try:
            await queue_place_release(
                model=self.plan.model, tenant=self.auth.tenant_slug, request_ids=request_ids, started=started
            )
        except Exception:  # a place left behind expires with the set (STALE_S)
            logger.exception("could not release the queue places of %s", self.plan.request_id)

    @property
    def deadline(self) -> float | None:
        """Unix time by which the request must have started: the shortest of its timeouts, from
        its arrival."""
        timeouts = [t for t in (self.client_timeout_s, self.auth.tenant_limits.queue_timeout_seconds) if t]
        return self.arrived_at + min(timeouts) if timeouts else None

    async def _release_unqueued(self, reserving: asyncio.Future) -> None:
        """A reservation made for a request cancelled before it was queued: settled to nothing,
        its concurrency slot freed, and its one ledger row written as cancelled."""
        try:
            self.reservation = await reserving
        except Exception:
            await self._release_queue_places()
            return  # refused: nothing was taken
        self.status = "cancelled"
        self.usage.prompt_tokens = 0  # nothing was computed
        await self._finish()

    async def _submit(self) -> None:
        plan = self.plan
        now = time.time()
        deadline = self.deadline
        if self._replica_wait_until is not None:
            deadline = min(deadline or self._replica_wait_until, self._replica_wait_until)
        if deadline is not None and deadline <= now:
            # Past its timeout before it was queued: no replica could start it, so none is asked to.
            self._never_started = True
            raise dropped_unstarted()
        for rid, prompt in zip(plan.engine_request_ids, plan.prompts, strict=True):
            self._pending.add(rid)
            await self.gateway.submit(
                GenerateRequest(
                    request_id=rid,
                    model=plan.model,
                    prompt_token_ids=prompt if plan.inputs is None else [],
                    task="generate" if plan.inputs is None else "embed",
                    inputs=plan.inputs,
                    sampling_params=dict(plan.sampling_params),
                    tenant=self.auth.tenant_slug,
                    # The prefix cache is shared within a tenant only; the body has no say in it.
                    cache_salt=f"tenant:{self.auth.tenant_id}",
                    lora=plan.lora,
                    created_at=now,
                    priority=plan.priority,
                    weight=float(self.auth.tenant_limits.fair_share_weight),
                    deadline=deadline,
                    stream=not self.quiet,
                ),
                once=bool(self.batch_id),
                route=RouteHint(
                    enabled=plan.prefix_routing,
                    block_size=plan.block_size,
                    prompt_cache_key=plan.prompt_cache_key,
                ),
            )

    async def _events(self) -> AsyncIterator[ChoiceDelta | ChoiceFinished | PromptLogprobs]:
        plan = self.plan
        offsets = {rid: i * plan.n for i, rid in enumerate(plan.engine_request_ids)}
        positions = {rid: "0-0" for rid in plan.engine_request_ids}
        finished: dict[str, set[int]] = {rid: set() for rid in plan.engine_request_ids}
        while self._pending:
            reading = {rid: positions[rid] for rid in self._pending}
            batch = await self.gateway.read(reading, block_ms=POLL_MS)
            positions.update(reading)
            if not batch:
                await self._check_alive()
                continue
            for rid, event in batch:
                if rid not in self._pending:
                    continue
                if rid in self._queued:  # its first event: it started, or ended without starting
                    self._release_started(rid, started=event.code != ErrorCode.QUEUE_TIMEOUT)
                if event.replica:
                    self._replicas[rid] = event.replica
                self._orphaned_at.pop(rid, None)
                if event.type == "failover":  # another replica continues it from here
                    self.failovers += 1
                    self._taken_over[rid] = self._last_delta_at.get(rid, time.perf_counter())
                    logger.info("request %s was taken over by engine replica %s", rid, event.replica)
                    continue
                if event.type == "error":
                    raise _engine_error(event)
                if event.type == "delta":
                    self._on_delta(rid)
                    if event.prompt_logprobs is not None:
                        yield PromptLogprobs(prompt=offsets[rid] // plan.n, entries=event.prompt_logprobs)
                    if plan.discard_output:
                        continue
                    for out in event.outputs:
                        token_ids = list(out.get("token_ids") or [])
                        self._on_tokens(len(token_ids))
                        yield ChoiceDelta(
                            index=offsets[rid] + int(out["index"]),
                            text=out.get("text") or "",
                            token_ids=token_ids,
                            logprobs=out.get("logprobs"),
                        )
                    continue
                if event.timing is not None:
                    metrics.record_engine_timing(
                        tenant=self.auth.tenant_slug, model=plan.model, timing=event.timing
                    )
                for out in event.outputs:
                    reason = out.get("finish_reason")
                    if FINISH_REASONS.get(reason) is None:  # type: ignore[call-overload]  # str keys
                        raise PlatformError(
                            f"The engine ended the request ({reason}).", code=ErrorCode.ENGINE_ERROR
                        )
                    reason = FINISH_REASONS[reason]
                    finished[rid].add(int(out["index"]))
                    if plan.discard_output:
                        reason = "length"  # max_tokens 0 was reached before any token
                    yield ChoiceFinished(
                        index=offsets[rid] + int(out["index"]),
                        finish_reason=reason,
                        stop_reason=out.get("stop_reason"),
                        embedding=out.get("embedding"),
                    )
                if event.usage is not None:
                    self._engine_usage[rid] = event.usage
                if event.usage is not None or len(finished[rid]) >= plan.n:
                    self._pending.discard(rid)

    def _on_delta(self, rid: str) -> None:
        now = self._last_delta_at[rid] = time.perf_counter()
        before = self._taken_over.pop(rid, None)
        if before is not None:
            metrics.record_failover(model=self.plan.model, gap_s=now - before)

    def _on_tokens(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
        elif self._last_token_at is not None and not self.quiet:  # a quiet one's deltas are not per token
            self._gaps.append(now - self._last_token_at)
        self._last_token_at = now
        self._produced += count

    async def _check_alive(self) -> None:
        """Fail instead of hanging when no replica will answer. A request no replica has started yet
        keeps waiting while any replica lives: a dead replica's queue is reclaimed by a live one. A
        started request whose replica is gone waits up to FAILOVER_WAIT_S for another (or the same,
        restarted) to take it over and continue its stream; with failovers off it fails at once."""
        model = self.plan.model
        try:
            live = await live_replica_set_async(model)
        except REDIS_CONNECTION_ERRORS as exc:
            now = time.monotonic()
            if self._redis_lost_at is None:
                self._redis_lost_at = now
            if now - self._redis_lost_at > REDIS_OUTAGE_GRACE_S:
                raise ServiceUnavailableError(
                    "The connection to the engines' queue was lost for too long.",
                    code="service_unavailable",
                ) from exc
            return
        self._redis_lost_at = None
        now = time.monotonic()
        for rid in self._pending:
            replica = self._replicas.get(rid)
            if replica is None:
                if not live:
                    if self._replica_wait_until is not None and time.time() < self._replica_wait_until:
                        continue  # waiting, queued, for the model's first replica
                    self._never_started = True
                    raise engine_unavailable(model)
            elif replica in live:
                self._orphaned_at.pop(rid, None)
            elif (
                not settings.MAX_FAILOVERS
                or now - self._orphaned_at.setdefault(rid, now) > settings.FAILOVER_WAIT_S
            ):
                raise ServiceUnavailableError(
                    "The engine replica serving this request stopped"
                    + (", and no other replica took it over." if settings.MAX_FAILOVERS else "."),
                    code="engine_unavailable",
                )

    async def _finish(self) -> None:
        plan = self.plan
        await self._release_queue_places()
        try:
            await self.gateway.forget(plan.engine_request_ids)
        except Exception:
            logger.exception("could not stop reading the streams of %s", plan.request_id)
        if self.error_code == ErrorCode.QUEUE_TIMEOUT or self._never_started:
            self.usage.prompt_tokens = 0  # dropped before anything was computed
        engine_completion = sum(u.get("completion_tokens", 0) for u in self._engine_usage.values())
        # Finished: the engine's count. Cancelled or failed: what was produced and delivered.
        self.usage.completion_tokens = engine_completion if self.status == "success" else self._produced
        if self.plan.discard_output:
            self.usage.completion_tokens = 0  # sampled only to finish the request: not delivered
        self.usage.cached_tokens = sum(u.get("cached_tokens", 0) for u in self._engine_usage.values())
        latency = time.perf_counter() - self.started_at
        ttft = None if self._first_token_at is None else self._first_token_at - self.started_at
        await self._settle(
            Settlement(
                prompt_tokens=self.usage.prompt_tokens,
                completion_tokens=self.usage.completion_tokens,
                cached_tokens=self.usage.cached_tokens,
                status=self.status,
                time_to_first_token_ms=None if ttft is None else ttft * 1000.0,
                latency_ms=latency * 1000.0,
                finished_at=time.time(),
            )
        )
        metrics.record_finished(
            tenant=self.auth.tenant_slug,
            model=plan.model,
            adapter=plan.adapter,
            status=self.status,
            prompt_tokens=self.usage.prompt_tokens,
            completion_tokens=self.usage.completion_tokens,
            cached_tokens=self.usage.cached_tokens,
            ttft_s=ttft,
            itl_s=self._gaps,
            latency_s=latency,
            error_code=self.error_code,
        )

    async def _settle(self, settlement: Settlement) -> None:
        """Abort the engine requests still running, settle the reservation and write the ledger
        row. While Redis is unreachable this waits for it, retrying with backoff: the owner of a
        request settles it as long as it lives (a settler takes over only when it is gone)."""
        plan = self.plan
        assert self.reservation is not None
        unfinished = sorted(self._pending)
        delay, lost_at = 0.1, None
        while True:
            try:
                if unfinished:
                    try:
                        await self.gateway.cancel(model=plan.model, request_ids=unfinished)
                    except REDIS_CONNECTION_ERRORS:
                        raise
                    except Exception:  # the request is settled all the same
                        logger.exception("could not signal the abort of %s", plan.request_id)
                    unfinished = []
                await blocking(settlement_close)(
                    reservation=self.reservation,
                    ledger=self.ledger_entry,
                    settlement=settlement,
                    release_keys=[usage_key(self.gateway.prefix, rid) for rid in plan.engine_request_ids],
                )
            except REDIS_CONNECTION_ERRORS as exc:
                if lost_at is None:
                    lost_at = time.monotonic()
                    logger.warning(
                        "Redis is unreachable (%s); %s is settled once it is back", exc, plan.request_id
                    )
                await asyncio.sleep(delay)
                delay = min(2 * delay, FINISH_RETRY_MAX_S)
                continue
            except Exception:
                logger.exception("could not settle %s", plan.request_id)
            if lost_at is not None:
                logger.info("settled %s after %.1f s", plan.request_id, time.monotonic() - lost_at)
            return


def _reserve_as_owner(**kwargs: Any) -> Reservation:
    """admission_reserve, with this process's owner key alive before its first reservation."""
    owner_ensure_beating()
    return admission_reserve(**kwargs)


_PLANNERS = {
    "chat": chat_plan_create,
    "completion": completion_plan_create,
    "embedding": embedding_plan_create,
}


async def generation_start(
    *,
    auth: AuthContext,
    kind: str,
    data: dict[str, Any],
    request_id: str,
    started_at: float | None = None,
    request_counted: bool = False,
    client_timeout_s: float | None = None,
    batch_id: str = "",
    streamed: bool | None = None,
) -> tuple[Generation, AsyncIterator[ChoiceDelta | ChoiceFinished]]:
    """Plan a validated chat or completion body (`kind`), reserve its tokens and queue it.

    The request counts against the requests/min limit before its prompt is tokenized (unless the
    caller counted it already: `request_counted`), so a tenant over its rate costs no tokenization.
    `streamed`: whether the caller passes the events on as they come (None: as the body's `stream`
    says); when not, the replicas publish them in fewer, larger deltas.
    Returns the Generation and its events (the choices' deltas and finishes). A refusal (rate
    limit, unknown model, context too long, no engine) raises here, counted in the metrics, before
    anything is queued or reserved; once this returns, the events must be consumed or closed, and
    whatever ends them settles the reservation and writes the ledger row."""
    plan, ready_read = None, None
    try:
        if not request_counted:
            await blocking(request_admit)(auth=auth, request_id=request_id)
        model = data.get("model")
        if model in auth.allowed_models:
            # A base model (an adapter's is known once planned): its ready replicas are read while
            # the prompt is planned, a Redis round trip or two off the time to the first token.
            ready_read = ReadyRead.start(model)
        plan = await blocking(_PLANNERS[kind])(auth=auth, data=data, request_id=request_id)
        prompt_logprob_volume_check(plan)
        timeouts = [t for t in (client_timeout_s, data.get("timeout")) if t]
        started_at = started_at or time.perf_counter()
        generation = Generation(
            auth=auth,
            plan=plan,
            started_at=started_at,
            arrived_at=time.time() - (time.perf_counter() - started_at),
            request_counted=True,
            client_timeout_s=min(timeouts) if timeouts else None,
            batch_id=batch_id,
            ready_read=ready_read,
            quiet=not (plan.stream if streamed is None else streamed),
        )
        ready_read = None  # the generation's now
        events = generation.run()
        await anext(events)  # admitted and queued
    except PlatformError as exc:
        metrics.record_refused(tenant=auth.tenant_slug, model=plan.model if plan else None, code=exc.code)
        raise
    finally:
        if ready_read is not None:
            ready_read.cancel()
    return generation, events


async def generation_attach(
    *, auth: AuthContext, kind: str, data: dict[str, Any], request_id: str
) -> tuple[Generation, AsyncIterator[ChoiceDelta | ChoiceFinished | PromptLogprobs]]:
    """A generation queued under `request_id` by a process that died, planned again from the same
    body (planning is deterministic) and read from its first event (Generation.attach)."""
    plan = await blocking(_PLANNERS[kind])(auth=auth, data=data, request_id=request_id)
    generation = Generation(auth=auth, plan=plan, request_counted=True)
    return generation, generation.attach()


@dataclass(slots=True)
class CollectedChoice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # its prompt's, when asked for


async def collect_choices(
    events: AsyncIterator[ChoiceDelta | ChoiceFinished | PromptLogprobs | None], *, count: int, n: int = 1
) -> list[CollectedChoice]:
    """Drain a generation into its `count` choices (non-streaming responses); `n` choices per prompt."""
    choices = [CollectedChoice(index=i) for i in range(count)]
    async for item in events:
        if isinstance(item, PromptLogprobs):
            for choice in choices[item.prompt * n : (item.prompt + 1) * n]:
                choice.prompt_logprobs = item.entries
            continue
        if isinstance(item, ChoiceDelta):
            choice = choices[item.index]
            choice.text += item.text
            choice.token_ids.extend(item.token_ids)
            choice.logprobs.extend(item.logprobs or [])
        elif isinstance(item, ChoiceFinished):
            choices[item.index].finish_reason = item.finish_reason
            choices[item.index].stop_reason = item.stop_reason
    return choices
