"""What the wire formats' bodies share, built from a generation's plan: usage, a token's logprob
entry, vLLM's prompt_logprobs, the fields of every streamed chunk, and the model objects."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from inference.services import ChoiceDelta, ChoiceFinished, GenerationPlan, GenerationUsage
from inference.tokenization import token_text


def usage_body(usage: GenerationUsage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def token_entry(plan: GenerationPlan, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(plan.model_path, int(token_id))
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


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


def anthropic_model_list(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The models list in Anthropic's shape (one page: the list is never long)."""
    data = [
        {
            "type": "model",
            "id": m["id"],
            "display_name": m["id"],
            "created_at": datetime.fromtimestamp(m["created"], UTC).isoformat().replace("+00:00", "Z"),
        }
        for m in models
    ]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def completion_object(
    plan: GenerationPlan, choices: list[dict[str, Any]], *, id: str, object: str
) -> dict[str, Any]:
    """The fields every completion object has, whole or streamed: id, object, created, model, the
    tier it ran on, and its choices."""
    return {
        "id": id,
        "object": object,
        "created": plan.created,
        "model": plan.served_model,
        "system_fingerprint": None,
        "service_tier": plan.service_tier,
        "choices": choices,
    }


def chunk_body(
    plan: GenerationPlan,
    choices: list[dict[str, Any]],
    *,
    id: str,
    object: str,
    usage: GenerationUsage | None = None,
) -> dict[str, Any]:
    """One streamed chunk. With include_usage every chunk carries `usage` (null but the last)."""
    body = completion_object(plan, choices, id=id, object=object)
    if plan.include_usage:
        body["usage"] = usage_body(usage) if usage is not None else None
    return body


class ChunkStream:
    """A wire format's renderer of a streamed generation (inference.api.<format>.render), which
    inference.api.sse sends: its subclass turns each item of the event stream into the chunks'
    choices, and gives the choices that open a stream where the format has any."""

    object: str  # each chunk's "object"

    def __init__(self, plan: GenerationPlan, id: str) -> None:
        self.plan, self.id = plan, id

    def chunk(self, choices: list[dict[str, Any]], usage: GenerationUsage | None = None) -> dict[str, Any]:
        return chunk_body(self.plan, choices, id=self.id, object=self.object, usage=usage)

    def opening(self) -> list[dict[str, Any]]:
        return []

    def choices(self, item: ChoiceDelta | ChoiceFinished) -> list[dict[str, Any]]:
        raise NotImplementedError
