"""How the worker takes a request entry into its engine: the request id of an entry too malformed
to decode, what a taken-over request's output stream says about it (engine.resume), and the
engine's refusals as error events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import EngineError, InvalidRequestError, RequestTooLargeError
from engine.lora.errors import LoRADisabledError, LoRALoadError
from engine.protocol import ErrorCode, Event, GenerateRequest, Usage
from engine.resume import Resume
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


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


def add_to_engine(engine: LLMEngine, request: GenerateRequest, resume: Resume | None = None) -> Event | None:
    """Adds the request to the engine; an error event when the engine refuses it."""
    try:
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
