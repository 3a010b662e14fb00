"""OpenAI's response and chunk shapes, built from a generation's choices and usage."""

from __future__ import annotations

from typing import Any

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


def chat_completion_body(
    plan: GenerationPlan, choices: list[CollectedChoice], usage: GenerationUsage
) -> dict[str, Any]:
    return {
        "id": chat_id(plan),
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.served_model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": chat_logprobs(plan, c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_body(usage),
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
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(plan, c.logprobs, offset=0),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_body(usage),
    }


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
