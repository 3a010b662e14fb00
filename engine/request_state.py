"""A request's state inside the engine: its completions (one per sequence of `n`), what each has
produced and not yet reported, and the checks of a request's fields that come before any state
changes. The engine (engine.llm_engine) keeps these by request id and sequence id."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

from engine.errors import EngineError, InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.protocol import FinishReason
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.stop_checker import FINISH_LENGTH, OutputStream

STATUS_OF_FINISH: dict[str, SequenceStatus] = {
    FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
    FINISH_LENGTH: SequenceStatus.FINISHED_LENGTH,
}


@dataclasses.dataclass(slots=True)
class Completion:
    seq: Sequence
    stream: OutputStream
    text: str = ""
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Delta accumulated during the current step, reset after it is reported.
    text_delta: str = ""
    token_ids_delta: list[int] = dataclasses.field(default_factory=list)
    logprobs_delta: list | None = None

    def output(self) -> CompletionOutput:
        out = CompletionOutput(
            index=self.seq.index,
            text=self.text,
            token_ids=list(self.seq.output_token_ids),
            text_delta=self.text_delta,
            token_ids_delta=self.token_ids_delta,
            logprobs_delta=self.logprobs_delta,
            cumulative_logprob=self.cumulative_logprob,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.text_delta, self.token_ids_delta = "", []
        self.logprobs_delta = None if self.seq.sampling_params.logprobs is None else []
        return out


@dataclasses.dataclass(slots=True)
class EngineRequest:
    request_id: str
    completions: list[Completion]
    num_prompt_tokens: int
    error: str | None = None
    error_code: str | None = None
    prompt_logprobs_due: bool = False  # asked for and not reported yet

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        """This step's deltas of every completion; the prompt's logprobs once, with the first
        output token."""
        first = self.completions[0].seq
        prompt_logprobs = None
        if self.prompt_logprobs_due and not first.wants_prompt_logprobs and first.num_output_tokens:
            prompt_logprobs = [None, *first.prompt_logprobs]
            self.prompt_logprobs_due = False
        return RequestOutput(
            request_id=self.request_id,
            outputs=[c.output() for c in self.completions],
            finished=self.finished,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            error=self.error,
            error_code=self.error_code,
            prompt_logprobs=prompt_logprobs,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a replica's heartbeat reports of its engine."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_free_blocks: int
    num_total_blocks: int
    loras_loaded: list[str]
    num_resumed_requests: int = 0
    num_resumed_tokens: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Spare-capacity steps given up since start for a more important arrival (engine.step_interrupt).
    num_interrupted_steps: int = 0


def check_request_fields(
    request_id: Any,
    sampling_params: Any,
    tenant: Any,
    cache_salt: Any,
    priority: Any,
    weight: Any,
    deadline: Any,
) -> None:
    """Refuses (InvalidRequestError) a field of the wrong type or range: checked before anything
    is queued, since a wrongly typed field would only fail at a later step(), and take every
    request in that step down with it."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
    if not isinstance(tenant, str) or not (cache_salt is None or isinstance(cache_salt, str)):
        raise InvalidRequestError("tenant and cache_salt must be strings")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < float("inf"):
        raise InvalidRequestError(f"weight must be a positive number, got {weight!r}")
    if deadline is not None and (
        isinstance(deadline, bool) or not isinstance(deadline, int | float) or deadline != deadline
    ):
        raise InvalidRequestError(f"deadline must be a unix time or None, got {deadline!r}")
    if not isinstance(sampling_params, SamplingParams):
        raise InvalidRequestError("sampling_params must be a SamplingParams")


def compile_error(future: Future) -> BaseException | None:
    """Why a grammar's compile failed (None: it did not)."""
    if future.cancelled():  # only when the engine shuts its compile pool down
        return EngineError("the engine stopped before the request's grammar was compiled")
    return future.exception()
