"""The completion's renderers of the one event stream: the whole body of a finished generation
(with an echoed prompt and its logprobs), and the chunks of a streamed one."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from inference.api.formatting import ChunkStream, completion_object, prompt_logprobs_body, usage_body
from inference.services import ChoiceDelta, ChoiceFinished, GenerationPlan, GenerationUsage
from inference.services.generation import CollectedChoice
from inference.tokenization import token_text


def completion_id(plan: GenerationPlan) -> str:
    return f"cmpl-{plan.request_id}"


def completion_logprobs(
    plan: GenerationPlan, entries: list[dict[str, Any]] | None, *, offset: int
) -> dict[str, Any] | None:
    """Legacy completions logprobs; `offset` is the choice's text length before these tokens."""
    if plan.logprobs is None:
        return None
    body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries or []:
        text = token_text(plan.model_path, int(entry["token_id"]))
        body["tokens"].append(text)
        body["token_logprobs"].append(float(entry["logprob"]))
        top = (entry.get("top") or [])[: plan.logprobs]
        body["top_logprobs"].append({token_text(plan.model_path, int(t)): float(lp) for t, lp in top})
        body["text_offset"].append(offset)
        offset += len(text)
    return body


def _echo_logprobs(
    plan: GenerationPlan, entries: list[dict[str, Any] | None], prompt: list[int]
) -> dict[str, Any]:
    """The prompt's part of an echoed choice's legacy logprobs: its first token has none."""
    body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, entry in zip(prompt, entries, strict=True):
        text = token_text(plan.model_path, int(token))
        body["tokens"].append(text)
        body["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        body["token_logprobs"].append(float(entry["logprob"]))
        top = (entry.get("top") or [])[: plan.logprobs]
        body["top_logprobs"].append({token_text(plan.model_path, int(t)): float(lp) for t, lp in top})
    return body


@dataclass(slots=True)
class _PromptParts:
    """What every choice of one prompt repeats, built once for all n of them: the echoed prompt's
    legacy logprobs and vLLM's prompt_logprobs (the choices' bodies share these objects)."""

    echoed: dict[str, Any] | None = None
    echo_end: int = 0  # the echoed tokens' text length: where the completion's offsets start
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


def _prompt_parts(plan: GenerationPlan, c: CollectedChoice, prompt_index: int) -> _PromptParts:
    parts = _PromptParts()
    if plan.echo and plan.logprobs is not None:
        parts.echoed = _echo_logprobs(plan, c.prompt_logprobs or [], plan.prompts[prompt_index])
        tokens, offsets = parts.echoed["tokens"], parts.echoed["text_offset"]
        parts.echo_end = offsets[-1] + len(tokens[-1]) if tokens else 0
    if plan.prompt_logprobs is not None:
        parts.prompt_logprobs = prompt_logprobs_body(plan, c.prompt_logprobs)
    return parts


def _text_choice(plan: GenerationPlan, c: CollectedChoice, parts: _PromptParts) -> dict[str, Any]:
    prompt_index = c.index // plan.n
    text, logprobs = c.text, completion_logprobs(plan, c.logprobs, offset=0)
    if plan.echo:
        text = plan.prompt_texts[prompt_index] + c.text
        if logprobs is not None and parts.echoed is not None:
            echoed, end = parts.echoed, parts.echo_end
            # max_tokens 0 (lm-evaluation-harness's scoring): the prompt's own body, shared.
            logprobs = (
                echoed
                if not logprobs["tokens"]
                else {
                    "tokens": echoed["tokens"] + logprobs["tokens"],
                    "token_logprobs": echoed["token_logprobs"] + logprobs["token_logprobs"],
                    "top_logprobs": echoed["top_logprobs"] + logprobs["top_logprobs"],
                    "text_offset": echoed["text_offset"] + [end + o for o in logprobs["text_offset"]],
                }
            )
    choice: dict[str, Any] = {
        "index": c.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
    }
    if plan.prompt_logprobs is not None:
        choice["prompt_logprobs"] = parts.prompt_logprobs
    return choice


def text_completion_body(
    plan: GenerationPlan, choices: list[CollectedChoice], usage: GenerationUsage
) -> dict[str, Any]:
    return {
        **completion_object(
            plan, _text_choices(plan, choices), id=completion_id(plan), object="text_completion"
        ),
        "usage": usage_body(usage),
    }


def _text_choices(plan: GenerationPlan, choices: list[CollectedChoice]) -> list[dict[str, Any]]:
    parts: dict[int, _PromptParts] = {}
    out = []
    for c in choices:
        prompt_index = c.index // plan.n
        if prompt_index not in parts:
            parts[prompt_index] = _prompt_parts(plan, c, prompt_index)
        out.append(_text_choice(plan, c, parts[prompt_index]))
    return out


class CompletionStream(ChunkStream):
    """The chunks of one streamed completion: each item of the event stream in, the chunks'
    choices out."""

    object = "text_completion"

    def __init__(self, plan: GenerationPlan) -> None:
        super().__init__(plan, completion_id(plan))
        self._offsets: dict[int, int] = defaultdict(int)  # each choice's text length so far

    def choices(self, item: ChoiceDelta | ChoiceFinished) -> list[dict[str, Any]]:
        if isinstance(item, ChoiceFinished):
            return [{"index": item.index, "text": "", "logprobs": None, "finish_reason": item.finish_reason}]
        logprobs = completion_logprobs(self.plan, item.logprobs, offset=self._offsets[item.index])
        if logprobs is not None:
            # Counted over the tokens' own texts, as the full answer does: the streamed text holds
            # back a character split over several tokens, and offsets must not depend on how it
            # was chunked.
            self._offsets[item.index] += sum(len(token) for token in logprobs["tokens"])
        return [{"index": item.index, "text": item.text, "logprobs": logprobs, "finish_reason": None}]
