"""What the engine hands back each step: per request, per completion, the full state and the delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampler import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int  # 0..n-1 within the request
    text: str  # everything streamed so far
    token_ids: list[int]
    # New since the previous step that reported this request: what a streaming client receives.
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprobs] | None = None  # one entry per new token, when logprobs were asked
    # Every token's logprobs: set only on the offline LLM's final outputs, which keep the whole run.
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    # What ended it when `error` is set: engine_error (a failed forward) or queue_timeout (its
    # queue deadline passed before it started; nothing was computed).
    error_code: str | None = None
    # The prompt's logprobs (None for its first token), in the first output once they are all
    # computed, when the request asked for them (SamplingParams.prompt_logprobs).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # An embedding request's vectors, one per input in order (engine.embedding_engine's wire form:
    # base64 of float32), on its finished output.
    embeddings: list[str] | None = None
