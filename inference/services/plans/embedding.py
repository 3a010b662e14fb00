"""The embedding's planner: every input (text, or token ids) tokenized as the model's tokenizer
makes a sentence (its special tokens included), checked against the model's context (or cut to
`truncate_prompt_tokens`, vLLM's extra), and sent to the engine as one embed request."""

from __future__ import annotations

from typing import Any

from core.errors import ContextLengthExceededError, InvalidRequestError
from inference import tokenization
from inference.services.plans.base import GenerationPlan, served_model_resolve, service_tier_resolve
from tenants.types import AuthContext


def _too_long(index: int, tokens: int, limit: int) -> ContextLengthExceededError:
    return ContextLengthExceededError(
        f"This model's maximum input length is {limit} tokens. However, input {index} has {tokens} "
        "tokens. Please reduce its length, or set truncate_prompt_tokens.",
        param="input",
    )


def embedding_plan_create(*, auth: AuthContext, data: dict[str, Any], request_id: str) -> GenerationPlan:
    target = served_model_resolve(auth=auth, model=data["model"], task="embed")
    deployment = target.deployment
    limit = deployment.max_model_len
    truncate = data.get("truncate_prompt_tokens")
    if truncate is not None and truncate > limit:
        raise InvalidRequestError(
            f"truncate_prompt_tokens may be at most the model's input length, {limit}.",
            param="truncate_prompt_tokens",
        )
    tokenizer = tokenization.get_tokenizer(deployment.model_path)
    vocab = len(tokenizer)
    fits = tokenization.PromptFit(max_model_len=limit, completion_tokens=0, what="input", param="input")
    inputs: list[list[int]] = []
    for i, item in enumerate(data["input"]):
        if isinstance(item, str):
            if truncate is None:
                fits.check_text(deployment.model_path, item)  # refused by its bytes before tokenizing
                ids = list(tokenizer.encode(item))
            else:
                # The tokenizer's own cut keeps the sentence's special tokens ([CLS] ... [SEP]).
                ids = list(tokenizer.encode(item, truncation=True, max_length=truncate))
        else:
            if any(t < 0 or t >= vocab for t in item):
                raise InvalidRequestError(f"Token ids must be in [0, {vocab}).", param="input")
            ids = list(item[-truncate:]) if truncate is not None else list(item)
        if not ids:
            raise InvalidRequestError(f"Input {i} makes no tokens.", param="input")
        if len(ids) > limit:
            raise _too_long(i, len(ids), limit)
        inputs.append(ids)
    return GenerationPlan(
        kind="embedding",
        request_id=request_id,
        **target.plan_fields(),
        prompts=[[t for ids in inputs for t in ids]],
        inputs=inputs,
        n=len(inputs),
        max_tokens=0,
        sampling_params={},
        discard_output=True,
        service_tier=service_tier_resolve(auth=auth, asked=None),
        end_user=data.get("user") or "",
    )
