"""vLLM's /tokenize and /detokenize: a served model's tokenizer, exactly as generation uses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import InvalidRequestError
from inference import tokenization
from inference.services.plans import served_model_resolve
from tenants.types import AuthContext


@dataclass(frozen=True, slots=True)
class Tokenized:
    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # only when asked for


def prompt_tokenize(
    *,
    auth: AuthContext,
    model: str,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = True,
    with_token_strs: bool = False,
) -> Tokenized:
    """The token ids of a text prompt, or of a conversation rendered by the model's chat template
    ready for the assistant's turn (what /v1/chat/completions would queue)."""
    deployment = served_model_resolve(auth=auth, model=model, task=None).deployment
    # Text that could not fit the context even in its most compact tokenization is refused unread.
    fits = tokenization.PromptFit(
        max_model_len=deployment.max_model_len,
        completion_tokens=0,
        what="messages" if messages is not None else "prompt",
        param="messages" if messages is not None else "prompt",
    )
    if messages is not None:
        tokens = tokenization.chat_prompt_ids(deployment.model_path, messages, fits=fits)
    else:
        tokens = tokenization.text_prompt_ids(
            deployment.model_path, prompt or "", add_special_tokens=add_special_tokens, fits=fits
        )
    token_strs = None
    if with_token_strs:
        token_strs = tokenization.get_tokenizer(deployment.model_path).convert_ids_to_tokens(tokens)
    return Tokenized(tokens=tokens, max_model_len=deployment.max_model_len, token_strs=token_strs)


def tokens_detokenize(*, auth: AuthContext, model: str, tokens: list[int]) -> str:
    deployment = served_model_resolve(auth=auth, model=model, task=None).deployment
    if len(tokens) > deployment.max_model_len:
        raise InvalidRequestError(
            f"At most {deployment.max_model_len} token ids (the model's context length) are detokenized at "
            f"once; {len(tokens)} were given.",
            param="tokens",
        )
    vocab = tokenization.vocab_size(deployment.model_path)
    if any(t >= vocab for t in tokens):
        raise InvalidRequestError(f"Token ids must be in [0, {vocab}).", param="tokens")
    return tokenization.get_tokenizer(deployment.model_path).decode(tokens)
