"""OpenAI's response and chunk shapes, built from a generation's choices and usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.api.chat_output import chat_message
from inference.services import GenerationPlan, GenerationUsage
from inference.services.generation import CollectedChoice
from inference.tokenization import token_text


def usage_body(usage: GenerationUsage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_id(plan: GenerationPlan) -> str:
    return f"chatcmpl-{plan.request_id}"


def completion_id(plan: GenerationPlan) -> str:
    return f"cmpl-{plan.request_id}"


def _token_entry(plan: GenerationPlan, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(plan.model_path, int(token_id))
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(plan: GenerationPlan, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if plan.logprobs is None:
        return None
    content = []
    for entry in entries or []:
        item = _token_entry(plan, entry["token_id"], entry["logprob"])
        item["top_logprobs"] = [_token_entry(plan, tid, lp) for tid, lp in (entry.get("top") or [])][
            : plan.logprobs
        ]
        content.append(item)
    return {"content": content, "refusal": None}


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


def prompt_logprobs_body(
    plan: GenerationPlan, entries: list[dict[str, Any] | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id (a string):
    {"logprob", "rank", "decoded_token"}} for the token itself and the top entries."""
    if plan.prompt_logprobs is None or entries is None:
        return None
    body: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            body.append(None)
            continue
        ranked = {str(entry["token_id"]): (entry["logprob"], entry.get("rank", 1))}
        for rank, (token, logprob) in enumerate((entry.get("top") or [])[: plan.prompt_logprobs], start=1):
            ranked.setdefault(str(token), (logprob, rank))
        body.append(
            {
                token: {
                    "logprob": float(lp),
                    "rank": int(rank),
                    "decoded_token": token_text(plan.model_path, int(token)),
                }
                for token, (lp, rank) in ranked.items()
            }
        )
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
        "id": chat_id(plan),
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.served_model,
        "system_fingerprint": None,
        "service_tier": plan.service_tier,
        "choices": [_chat_choice(plan, c) for c in choices],
        "usage": usage_body(usage),
        **(
            {"prompt_logprobs": prompt_logprobs_body(plan, choices[0].prompt_logprobs if choices else None)}
            if plan.prompt_logprobs is not None
            else {}
        ),
    }


def text_completion_body(
    plan: GenerationPlan, choices: list[CollectedChoice], usage: GenerationUsage
) -> dict[str, Any]:
    return {
        "id": completion_id(plan),
        "object": "text_completion",
        "created": plan.created,
        "model": plan.served_model,
        "system_fingerprint": None,
        "service_tier": plan.service_tier,
        "choices": _text_choices(plan, choices),
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


def chunk(
    plan: GenerationPlan, choices: list[dict[str, Any]], *, usage: GenerationUsage | None = None
) -> dict:
    """One streamed chunk. With include_usage every chunk carries `usage` (null but the last)."""
    body: dict[str, Any] = {
        "id": chat_id(plan) if plan.kind == "chat" else completion_id(plan),
        "object": "chat.completion.chunk" if plan.kind == "chat" else "text_completion",
        "created": plan.created,
        "model": plan.served_model,
        "system_fingerprint": None,
        "service_tier": plan.service_tier,
        "choices": choices,
    }
    if plan.include_usage:
        body["usage"] = usage_body(usage) if usage is not None else None
    return body


def model_object(*, deployment, adapter=None, tenant_slug: str) -> dict[str, Any]:
    """A base model, or a tenant's adapter as vLLM lists LoRA modules (its base model as parent)."""
    if adapter is None:
        created = int(deployment.created_at.timestamp())
        return {"id": deployment.name, "object": "model", "created": created, "owned_by": "pagoda"}
    return {
        "id": adapter.name,
        "object": "model",
        "created": int(adapter.created_at.timestamp()),
        "owned_by": tenant_slug,
        "parent": deployment.name,
    }
