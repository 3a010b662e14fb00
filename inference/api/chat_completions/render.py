"""The chat completion's renderers of the one event stream: the whole body of a finished
generation, and the chunks of a streamed one (role first, then content or tool-call deltas)."""

from __future__ import annotations

from typing import Any

from inference.api.chat_completions.messages import ChoiceMessageStream, chat_message
from inference.api.formatting import (
    ChunkStream,
    completion_object,
    prompt_logprobs_body,
    token_entry,
    usage_body,
)
from inference.services import ChoiceDelta, ChoiceFinished, GenerationPlan, GenerationUsage
from inference.services.generation import CollectedChoice


def chat_id(plan: GenerationPlan) -> str:
    return f"chatcmpl-{plan.request_id}"


def chat_logprobs(plan: GenerationPlan, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if plan.logprobs is None:
        return None
    content = []
    for entry in entries or []:
        item = token_entry(plan, entry["token_id"], entry["logprob"])
        item["top_logprobs"] = [token_entry(plan, tid, lp) for tid, lp in (entry.get("top") or [])][
            : plan.logprobs
        ]
        content.append(item)
    return {"content": content, "refusal": None}


def _chat_choice(plan: GenerationPlan, c: CollectedChoice) -> dict[str, Any]:
    message, finish_reason = chat_message(plan, c.text, c.finish_reason)
    return {
        "index": c.index,
        "message": message,
        "logprobs": chat_logprobs(plan, c.logprobs),
        "finish_reason": finish_reason,
    }


def chat_completion_body(
    plan: GenerationPlan, choices: list[CollectedChoice], usage: GenerationUsage
) -> dict[str, Any]:
    return {
        **completion_object(
            plan, [_chat_choice(plan, c) for c in choices], id=chat_id(plan), object="chat.completion"
        ),
        "usage": usage_body(usage),
        **(
            {"prompt_logprobs": prompt_logprobs_body(plan, choices[0].prompt_logprobs if choices else None)}
            if plan.prompt_logprobs is not None
            else {}
        ),
    }


class ChatStream(ChunkStream):
    """The chunks of one streamed chat completion: each item of the event stream in, the chunks'
    choices out."""

    object = "chat.completion.chunk"

    def __init__(self, plan: GenerationPlan) -> None:
        super().__init__(plan, chat_id(plan))
        # A chat with tools or a reasoning parser reads each choice's text into reasoning, content
        # and tool-call deltas.
        self._tools: dict[int, ChoiceMessageStream] | None = {} if plan.parses_message else None

    def opening(self) -> list[dict[str, Any]]:
        """Each choice's role, before any token."""
        return [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for index in range(self.plan.n * len(self.plan.prompts))
        ]

    def choices(self, item: ChoiceDelta | ChoiceFinished) -> list[dict[str, Any]]:
        if self._tools is not None:
            return self._tool_choices(item, self._tools)
        if isinstance(item, ChoiceFinished):
            return [{"index": item.index, "delta": {}, "logprobs": None, "finish_reason": item.finish_reason}]
        logprobs = chat_logprobs(self.plan, item.logprobs)
        return [
            {
                "index": item.index,
                "delta": {"content": item.text},
                "logprobs": logprobs,
                "finish_reason": None,
            }
        ]

    def _tool_choices(
        self, item: ChoiceDelta | ChoiceFinished, streams: dict[int, ChoiceMessageStream]
    ) -> list[dict[str, Any]]:
        """Its text read into reasoning, content and tool-call deltas (none while a call or a
        closing tag is being read), then the finish."""
        stream = streams.get(item.index)
        if stream is None:
            stream = streams[item.index] = ChoiceMessageStream(self.plan)
        if isinstance(item, ChoiceFinished):
            deltas, reason = stream.finish(item.finish_reason)
            out = [{"index": item.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            return [*out, {"index": item.index, "delta": {}, "logprobs": None, "finish_reason": reason}]
        logprobs = chat_logprobs(self.plan, item.logprobs)
        deltas = stream.feed(item.text)
        if not deltas and logprobs is not None:
            deltas = [{}]  # the tokens' logprobs go out even while their text is held back
        out = []
        for delta in deltas:
            out.append({"index": item.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
            logprobs = None
        return out
