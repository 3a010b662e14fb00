"""Tokenizers of served models, loaded once per process from the model directory (offline).

The web tier tokenizes to check the context length and to reserve tokens before anything is
queued; the engine receives token ids, so both sides agree on the prompt by construction.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from core.errors import InvalidRequestError, ServiceUnavailableError
from engine.chat_template import ChatTemplateError, chat_prompt_token_ids

logger = logging.getLogger(__name__)
_load_lock = threading.Lock()


@functools.cache
def _load(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def get_tokenizer(model_path: str) -> Any:
    # The lock keeps concurrent first requests from loading the same tokenizer several times.
    with _load_lock:
        try:
            return _load(model_path)
        except Exception as exc:  # missing files, a malformed tokenizer.json, an unknown class
            # The reason names the host's paths: the operator's log has it, the caller does not.
            logger.error("the tokenizer of %s could not be loaded: %s", model_path, exc)
            raise ServiceUnavailableError(
                "The model's tokenizer could not be loaded; the platform operator has been told.",
                code="model_unavailable",
            ) from exc


def chat_prompt_ids(
    model_path: str, messages: list[dict[str, Any]], *, tools: list | None = None
) -> list[int]:
    """Token ids of the conversation (and its tools) rendered by the model's chat template, ready
    for the assistant's turn; text in the messages never becomes a control token."""
    tokenizer = get_tokenizer(model_path)
    try:
        return chat_prompt_token_ids(tokenizer, messages, tools)
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc


def text_prompt_ids(model_path: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return list(get_tokenizer(model_path).encode(text, add_special_tokens=add_special_tokens))


def vocab_size(model_path: str) -> int:
    return len(get_tokenizer(model_path))


@functools.lru_cache(maxsize=65536)
def _token_text(model_path: str, token_id: int) -> str:
    return get_tokenizer(model_path).decode([token_id])


def token_text(model_path: str, token_id: int) -> str:
    """The text of one token as OpenAI's logprobs show it."""
    return _token_text(model_path, token_id)
