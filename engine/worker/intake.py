"""How the worker takes a request entry into its engine: the request id of an entry too malformed
to decode, what a reclaimed request's output stream says about it, and the engine's refusals as
error events."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from engine.errors import EngineError, InvalidRequestError, RequestTooLargeError
from engine.lora.errors import LoRADisabledError, LoRALoadError
from engine.protocol import ErrorCode, Event, GenerateRequest, Usage
from engine.sampling_params import SamplingParams, SamplingParamsError

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


def settle_reclaimed(
    request: GenerateRequest, seen: list[Event], deliveries: int, max_deliveries: int
) -> tuple[bool, Event | None]:
    """For a request reclaimed from a dead replica, given the events its output stream holds:
    whether it is settled already or now (not to run here), and the event that settles it now.
    - Finished or failed: settled, nothing more to send.
    - Part of its output streamed: running it again would stream its text a second time to a
      reader that already has part; it ends with engine_failed, billed for what was sent.
    - Delivered more than max_deliveries times: it failed on that many replicas; engine_failed.
    - Otherwise it runs here."""
    if any(e.type in ("finished", "error") for e in seen):
        return True, None
    produced = sum(len(o.get("token_ids", ())) for e in seen if e.type == "delta" for o in e.outputs)
    usage = Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=produced)
    if any(e.type == "delta" for e in seen):
        return True, Event.error(
            "the engine replica serving this request stopped", ErrorCode.ENGINE_FAILED, usage
        )
    if deliveries > max_deliveries:
        return True, Event.error(
            f"the request failed on {deliveries - 1} engine replicas", ErrorCode.ENGINE_FAILED, usage
        )
    return False, None


def add_to_engine(engine: LLMEngine, request: GenerateRequest) -> Event | None:
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
