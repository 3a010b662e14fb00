"""Turning the engine's RequestOutputs into wire events, with the per-request bookkeeping that needs.

The worker keeps its own count of tokens sent per index, so an aborted or failed request can be
settled (usage of what was produced) without asking the engine, whose state for it is gone.

A quiet request (GenerateRequest.stream false: its reader answers once, with the whole text) gets
its first delta at once, as any request (its time to first token, and which replica holds it), then
one delta for everything produced since, at its end or once `quiet_publish_s` has passed: instead of
an entry per step, each written by the replica and read, decoded and gathered by the web tier.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import DeltaOutput, ErrorCode, Event, FinishedOutput, FinishReason, Usage
from engine.worker.queue import EntryRef

# The longest a quiet request's output waits unpublished, by default (WorkerSettings.quiet_publish_s):
# what a replica lost in that time is all that the one continuing it computes again (it resumes
# from the stream).
QUIET_PUBLISH_S = 1.0


@dataclass(slots=True)
class HeldRequest:
    """A request this replica has taken from the stream and not yet acked."""

    request_id: str
    message_id: EntryRef  # its entry in a request stream; acked when the request ends
    n: int
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    completion_tokens: list[int] = field(default_factory=list)  # tokens sent so far, per index
    finish_reasons: dict[int, FinishedOutput] = field(default_factory=dict)
    replica_marked: bool = False  # its stream says this replica holds it (first delta, or failover)
    queued_at: float = 0.0  # unix time the web tier queued it (0: it streamed on a lost replica)
    taken_at: float = field(default_factory=time.time)  # unix time this replica took it
    first_token_at: float | None = None  # unix time the step that produced its first token here ended
    quiet: bool = False  # its deltas after the first are held back and published together
    held_back: Event | None = None  # a quiet request's deltas since its last publication, merged
    held_back_since: float = 0.0  # monotonic time of the oldest of them

    def __post_init__(self) -> None:
        if not self.completion_tokens:
            self.completion_tokens = [0] * self.n

    @property
    def has_streamed(self) -> bool:
        return any(self.completion_tokens)

    def to_publish(self, events: list[Event], now: float, period_s: float = QUIET_PUBLISH_S) -> list[Event]:
        """Of one step's events for a quiet request, those to publish now: its deltas are held back
        (merged) until its end, or until the oldest has waited `period_s`."""
        out: list[Event] = []
        for event in events:
            if event.type != "delta":
                out.extend(self.release())
                out.append(event)
            elif self.held_back is None:
                self.held_back, self.held_back_since = _copied(event), now
            else:
                _merge_into(self.held_back, event)
        if self.held_back is not None and now - self.held_back_since >= period_s:
            out.extend(self.release())
        return out

    def release(self) -> list[Event]:
        """The deltas held back, as one event to publish now (none when nothing is held)."""
        held, self.held_back = self.held_back, None
        return [held] if held is not None else []

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=sum(self.completion_tokens),
            cached_tokens=self.num_cached_tokens,
        )

    def timing(self) -> dict[str, float]:
        """The finished event's `timing` (engine.protocol.Event)."""
        timing = {"queued": self.queued_at, "taken": self.taken_at}
        if self.first_token_at is not None:
            timing["first_token"] = self.first_token_at
        return timing

    def aborted_event(self) -> Event:
        """The finished event for a cancel: indices that had already ended keep their own reason."""
        outputs = [
            self.finish_reasons.get(i) or FinishedOutput(index=i, finish_reason=FinishReason.ABORT)
            for i in range(self.n)
        ]
        return Event.finished(outputs, self.usage(), self.timing())


def events_for_output(held: HeldRequest, output: Any) -> list[Event]:
    """Events for one RequestOutput of one step: a delta when any index progressed, then the end."""
    events: list[Event] = []
    deltas: list[DeltaOutput] = []
    for completion in output.outputs:
        index = completion.index
        token_ids = list(completion.token_ids_delta or ())
        text = completion.text_delta or ""
        if token_ids or text:
            if token_ids and held.first_token_at is None:
                held.first_token_at = time.time()
            held.completion_tokens[index] += len(token_ids)
            deltas.append(
                DeltaOutput(
                    index=index,
                    text=text,
                    token_ids=token_ids,
                    logprobs=_wire_logprobs(completion.logprobs_delta),
                )
            )
        if completion.finish_reason is not None and index not in held.finish_reasons:
            held.finish_reasons[index] = FinishedOutput(
                index=index, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason
            )
    if output.num_cached_tokens is not None:
        held.num_cached_tokens = output.num_cached_tokens
    if output.num_prompt_tokens:
        held.num_prompt_tokens = output.num_prompt_tokens
    prompt_logprobs = getattr(output, "prompt_logprobs", None)
    if deltas or prompt_logprobs is not None:
        event = Event.delta(deltas)
        if prompt_logprobs is not None:
            event.prompt_logprobs = [
                None
                if entry is None
                else {
                    "token_id": int(entry.token_id),
                    "logprob": _finite(entry.logprob),
                    "rank": int(entry.rank),
                    "top": [[int(tok), _finite(lp)] for tok, lp in entry.top_logprobs],
                }
                for entry in prompt_logprobs
            ]
        events.append(event)
    if getattr(output, "error", None):
        code = getattr(output, "error_code", None) or ErrorCode.ENGINE_ERROR
        # Dropped before it started: nothing was computed, so nothing is billed.
        usage = (
            Usage(prompt_tokens=0, completion_tokens=0) if code == ErrorCode.QUEUE_TIMEOUT else held.usage()
        )
        events.append(Event.error(str(output.error), code, usage))
    elif output.finished:
        outputs = [
            held.finish_reasons.get(i) or FinishedOutput(index=i, finish_reason=FinishReason.STOP)
            for i in range(held.n)
        ]
        embeddings = getattr(output, "embeddings", None)
        if embeddings is not None:
            for finished, vector in zip(outputs, embeddings, strict=True):
                finished.embedding = vector
        events.append(Event.finished(outputs, held.usage(), held.timing()))
    return events


def _copied(event: Event) -> Event:
    """A delta whose outputs may be extended without touching the event it came from."""
    return Event(
        type="delta",
        outputs=[_copied_output(out) for out in event.outputs],
        prompt_logprobs=event.prompt_logprobs,
    )


def _copied_output(out: dict[str, Any]) -> dict[str, Any]:
    logprobs = out.get("logprobs")
    return {
        **out,
        "token_ids": list(out["token_ids"]),
        "logprobs": list(logprobs) if logprobs is not None else None,
    }


def _merge_into(merged: Event, event: Event) -> None:
    """`event`'s outputs appended to `merged`'s, index by index, as if one step had produced both."""
    if merged.prompt_logprobs is None:
        merged.prompt_logprobs = event.prompt_logprobs
    by_index = {out["index"]: out for out in merged.outputs}
    for out in event.outputs:
        into = by_index.get(out["index"])
        if into is None:
            merged.outputs.append(_copied_output(out))
            by_index[out["index"]] = merged.outputs[-1]
            continue
        into["text"] += out["text"]
        into["token_ids"].extend(out["token_ids"])
        if out.get("logprobs"):
            into["logprobs"] = (into["logprobs"] or []) + out["logprobs"]


def _wire_logprobs(entries: Any) -> list[dict[str, Any]] | None:
    """The sampler's TokenLogprobs as JSON: {"token_id", "logprob", "top": [[token_id, logprob], ...]}."""
    if not entries:
        return None
    return [
        {
            "token_id": int(entry.token_id),
            "logprob": _finite(entry.logprob),
            "top": [[int(tok), _finite(lp)] for tok, lp in entry.top_logprobs],
        }
        for entry in entries
        if entry is not None
    ]


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients show -9999.0 for a token with zero probability.
    value = float(value)
    return value if math.isfinite(value) else -9999.0
