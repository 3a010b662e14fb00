"""How the worker takes request entries into its engine (Intake): reading, reclaiming and taking
over entries, the request id of an entry too malformed to decode, what a taken-over request's
output stream says about it (engine.resume), and the engine's refusals as error events."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import EngineError, InvalidRequestError, RequestTooLargeError
from engine.lora.errors import LoRADisabledError, LoRALoadError
from engine.protocol import ErrorCode, Event, GenerateRequest, ProtocolError, Usage
from engine.resume import Resume
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker.outputs import HeldRequest
from engine.worker.queue import Entry, EntryRef
from engine.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.embedding_engine import EmbeddingEngine
    from engine.llm_engine import LLMEngine
    from engine.worker.loop import EngineWorker

logger = logging.getLogger("engine.worker")


def request_id_of(fields: dict) -> str | None:
    """The request id of an entry that does not decode, when it names one (to answer it)."""
    try:
        raw = json.loads(fields.get(b"data", fields.get("data")) or "null")
    except (TypeError, ValueError):
        return None
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    return request_id if isinstance(request_id, str) and request_id else None


@dataclass(frozen=True, slots=True)
class Takeover:
    """What a replica does with a request that another replica held (reclaimed from a dead one, or
    handed back by a stopping one), given what its output stream shows."""

    settled: bool  # answered already, or answered now by `event`: not to run here
    event: Event | None = None
    resume: Resume | None = None  # it streamed: continue it from there


def take_over(
    request: GenerateRequest, seen: list[Event], deliveries: int, settings: WorkerSettings
) -> Takeover:
    """- Finished or failed: settled, nothing more to send.
    - Part of its output streamed: continued here from what was sent (a failover), unless it has
      lost its replica more than max_failovers times, or was delivered more than max_deliveries
      times (it may be what kills the replicas taking it); then it ends with engine_failed,
      billed for what was sent.
    - Nothing streamed: it runs here from its start, within the same max_deliveries."""
    if any(e.type in ("finished", "error") for e in seen):
        return Takeover(settled=True)
    n = request.sampling_params.get("n", 1) if isinstance(request.sampling_params, dict) else 1
    try:
        resume = Resume.from_events(seen, n if isinstance(n, int) and n > 0 else 1)
    except InvalidRequestError:
        resume, seen = None, [*seen, Event(type="delta")]  # unreadable: never continue it
    usage = Usage(
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=resume.num_tokens if resume is not None else 0,
    )
    streamed = any(e.type == "delta" for e in seen)
    if streamed and (resume is None or resume.failovers > settings.max_failovers):
        lost = (
            "stopped"
            if resume is None or settings.max_failovers == 0
            else f"was lost {resume.failovers} times"
        )
        return Takeover(
            True,
            Event.error(f"the engine replica serving this request {lost}", ErrorCode.ENGINE_FAILED, usage),
        )
    if deliveries > settings.max_deliveries:
        return Takeover(
            True,
            Event.error(
                f"the request failed on {deliveries - 1} engine replicas", ErrorCode.ENGINE_FAILED, usage
            ),
        )
    return Takeover(settled=False, resume=resume)


def add_to_engine(
    engine: LLMEngine | EmbeddingEngine, request: GenerateRequest, resume: Resume | None = None
) -> Event | None:
    """Adds the request to the engine; an error event when the engine refuses it."""
    try:
        if request.task == "embed":
            add = getattr(engine, "add_embedding_request", None)
            if add is None:
                return Event.error(
                    "this model generates text; it does not compute embeddings", ErrorCode.INVALID_REQUEST
                )
            add(
                request.request_id,
                request.inputs,
                tenant=request.tenant,
                priority=request.priority,
                weight=request.weight,
                deadline=request.deadline,
            )
            return None
        params = SamplingParams.from_dict(request.sampling_params)
        engine.add_request(
            request.request_id,
            request.prompt_token_ids,
            params,
            tenant=request.tenant,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora=request.lora,  # the engine keys it by (tenant, name, version)
            weight=request.weight,
            deadline=request.deadline,
            resume=resume,
        )
    except LoRADisabledError:
        return Event.error("this engine replica does not serve LoRA adapters", ErrorCode.LORA_UNAVAILABLE)
    except LoRALoadError as exc:
        return Event.error(str(exc), ErrorCode.LORA_LOAD_FAILED)
    except RequestTooLargeError as exc:
        return Event.error(str(exc), ErrorCode.REQUEST_TOO_LARGE)
    except (InvalidRequestError, SamplingParamsError, TypeError, ValueError) as exc:
        # An error that names its own code (a grammar refused from the cache) keeps it.
        return Event.error(str(exc), getattr(exc, "code", None) or ErrorCode.INVALID_REQUEST)
    except EngineError as exc:
        return Event.error(str(exc), ErrorCode.ENGINE_ERROR)
    return None


class Intake:
    """How a replica takes requests: new ones from its model's stream, entries of replicas that
    stopped touching them (the claim timeout) or whose heartbeat lapsed (at once), each checked
    against its output stream when another replica may have streamed it (take_over), then added
    to the engine. It keeps the worker's books (held requests, events and acks to send)."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker

    def read_new(self, *, block: bool) -> list[str] | None:
        """Take the new entries there is room for; returns the cancels read with them (None when
        the replica is full and read nothing)."""
        w = self.worker
        room = w.max_held - len(w.held)
        if room <= 0:
            return None
        read = w.queue.read_turn(room, w.settings.idle_block_ms if block else None)
        self.take_new(read.entries or [])
        return read.cancels

    def take_new(self, entries: list[Entry]) -> None:
        """Take entries read as new (by read_new, or ahead by the last publish)."""
        for message_id, fields in entries:
            self.take(message_id, fields)

    def steal(self) -> None:
        """Take requests routed to other replicas that waited there past the steal delay; only while
        this replica is idle (nothing running or waiting): a replica that is merely less busy would
        start them sooner than their own replica's next step, but without their prefix cached."""
        w = self.worker
        room = w.max_held - len(w.held)
        if room <= 0 or w.settings.steal_after_ms <= 0 or w.engine.has_unfinished_requests():
            return
        for message_id, fields in w.queue.steal(room, w.settings.steal_after_ms):
            logger.info("stole request entry %s from %s", message_id.id, message_id.stream)
            self.take(message_id, fields)

    def reclaim(self) -> None:
        w = self.worker
        room = w.max_held - len(w.held)
        if room <= 0:
            return
        for message_id, fields, deliveries in w.queue.autoclaim(w.settings.claim_timeout_ms, room):
            logger.info("reclaimed request entry %s (delivery %d)", message_id, deliveries)
            self.take(message_id, fields, reclaimed=True, deliveries=deliveries)

    def claim_orphans(self) -> None:
        w = self.worker
        room = w.max_held - len(w.held)
        if room <= 0:
            return
        for message_id, fields, deliveries in w.queue.claim_orphans(room):
            logger.info(
                "took over request entry %s from a lost replica (delivery %d)", message_id, deliveries
            )
            self.take(message_id, fields, reclaimed=True, deliveries=deliveries)

    def take(
        self, message_id: EntryRef, fields: dict, *, reclaimed: bool = False, deliveries: int = 1
    ) -> None:
        w = self.worker
        try:
            request = GenerateRequest.decode(fields)
        except ProtocolError as exc:
            request_id = request_id_of(fields)
            logger.warning("malformed request entry %s (request %r): %s", message_id, request_id, exc)
            if request_id:
                w.events.append((request_id, Event.error(str(exc), ErrorCode.INVALID_REQUEST)))
            w.acks.append(message_id)
            return
        held = w.held.get(request.request_id)
        if held is not None:
            # A second delivery of a request already running here (its entry was re-added), or the
            # same entry read again after a read whose answer was lost with the connection.
            if held.message_id != message_id:
                w.acks.append(message_id)
            return
        resume = None
        # An entry that another replica held (reclaimed, or handed back by a stopping one) may have
        # streamed: its output stream says whether it is settled, or continues from where it was.
        if reclaimed or b"handed" in fields or "handed" in fields:
            takeover = self._take_over(request, message_id, deliveries)
            if takeover.settled:
                return
            resume = takeover.resume
        held = HeldRequest(
            request_id=request.request_id,
            message_id=message_id,
            n=request.num_outputs,
            num_prompt_tokens=request.num_prompt_tokens,
            # A request that streamed elsewhere was not waiting in the queue since it was queued.
            queued_at=request.created_at if resume is None else 0.0,
            quiet=not request.stream,
        )
        if resume is not None:
            held.completion_tokens = [len(tokens) for tokens in resume.outputs]
            held.replica_marked = True  # by the failover marker
        if w.cancelled.pop(request.request_id, None) is not None:
            w.end(held, held.aborted_event())
            return
        error = add_to_engine(w.engine, request, resume)
        if error is not None:
            w.end(held, error)
            return
        w.held[request.request_id] = held

    def _take_over(self, request: GenerateRequest, message_id: EntryRef, deliveries: int) -> Takeover:
        w = self.worker
        try:
            seen, _ = w.queue.take_over(request.request_id)
        except ProtocolError:
            seen = [Event(type="error")]  # unreadable output: never stream a second answer into it
        takeover = take_over(request, seen, deliveries, w.settings)
        if takeover.event is not None:
            w.events.append((request.request_id, takeover.event))
        if takeover.settled:
            w.acks.append(message_id)
        elif takeover.resume is not None:
            logger.info(
                "continuing request %s after %d tokens (failover %d)",
                request.request_id,
                takeover.resume.num_tokens,
                takeover.resume.failovers,
            )
        return takeover
