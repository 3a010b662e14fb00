"""Tokenizers of served models, loaded once per process from the model directory (offline).

The web tier tokenizes to check the context length and to reserve tokens before anything is
queued; the engine receives token ids, so both sides agree on the prompt by construction.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
from typing import Any

from core.errors import ContextLengthExceededError, InvalidRequestError, ServiceUnavailableError
from engine.chat_template import ChatTemplateError, RenderedTooLong, chat_prompt_token_ids

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


def tokenizers_load(model_paths: list[str]) -> int:
    """Load these models' tokenizers now, so that no request of this process pays for the first
    load (transformers' import and the tokenizer files: seconds of CPU). Returns how many loaded; a
    tokenizer that cannot be loaded is logged, and its requests get the error when they come."""
    loaded = 0
    for model_path in dict.fromkeys(model_paths):
        try:
            get_tokenizer(model_path)
        except ServiceUnavailableError:
            continue
        loaded += 1
    return loaded


def chat_prompt_ids(
    model_path: str,
    messages: list[dict[str, Any]],
    *,
    tools: list | None = None,
    fits: PromptFit | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the conversation (and its tools) rendered by the model's chat template, ready
    for the assistant's turn; text in the messages never becomes a control token. With `fits`, a
    rendering too long to fit is refused before it is tokenized. `template_kwargs`: the template's
    own variables (chat_template_kwargs)."""
    tokenizer = get_tokenizer(model_path)
    max_bytes = fits.max_bytes(model_path) if fits else None
    try:
        return chat_prompt_token_ids(
            tokenizer, messages, tools, max_text_bytes=max_bytes, template_kwargs=template_kwargs
        )
    except RenderedTooLong as exc:
        assert fits is not None
        raise fits.exceeded(model_path, exc.size) from exc
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc


def text_prompt_ids(
    model_path: str, text: str, *, add_special_tokens: bool = True, fits: PromptFit | None = None
) -> list[int]:
    if fits is not None:
        fits.check_text(model_path, text)
    return list(get_tokenizer(model_path).encode(text, add_special_tokens=add_special_tokens))


def vocab_size(model_path: str) -> int:
    return len(get_tokenizer(model_path))


@functools.lru_cache(maxsize=65536)
def _token_text(model_path: str, token_id: int) -> str:
    return get_tokenizer(model_path).decode([token_id])


def token_text(model_path: str, token_id: int) -> str:
    """The text of one token as OpenAI's logprobs show it."""
    return _token_text(model_path, token_id)


# Normalizers that never make text shorter (in UTF-8 bytes) than by this factor; others (NFKC,
# Strip, Lowercase, sentencepiece's Precompiled, which drops characters) give no bound.
_NORMALIZER_SHRINK = {"Prepend": 1, "NFC": 3}  # NFC: three Hangul jamo (9 bytes) compose to 3
# Pre-tokenizers that keep every byte of the text (Whitespace and the like drop spaces).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


def _shrink_factor(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            part_factor = _shrink_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind == "Replace":
        pattern, content = (normalizer.get("pattern") or {}).get("String"), normalizer.get("content", "")
        grows = isinstance(pattern, str) and len(content.encode()) >= len(pattern.encode())
        return 1 if grows else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_bytes(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_bytes(p) for p in pre_tokenizer.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


@functools.cache
def _max_token_bytes(model_path: str) -> int | None:
    tokenizer = get_tokenizer(model_path)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    config = json.loads(backend.to_str())
    model = config.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return None  # one unknown token may stand for a run of unknown characters of any length
    factor = _shrink_factor(config.get("normalizer"))
    if factor is None or not _keeps_bytes(config.get("pre_tokenizer")):
        return None
    added = config.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None  # such a token swallows the whitespace beside it, however much
    # Byte-level vocabularies spell each byte as one character; others spell text, whose UTF-8
    # length bounds the bytes it stands for (a byte-fallback token <0x41> stands for one).
    byte_level = "ByteLevel" in json.dumps(config.get("pre_tokenizer"))
    vocab = model.get("vocab") or {}
    longest = max((len(k) if byte_level else len(k.encode()) for k in vocab), default=0)
    longest = max(longest, 4, *(len(str(t.get("content", "")).encode()) for t in added))
    return factor * longest


def max_token_bytes(model_path: str) -> int | None:
    """The most bytes (UTF-8) of prompt text one token of this tokenizer can stand for, or None
    where the tokenizer gives no such bound. Computed once per tokenizer."""
    return _max_token_bytes(model_path)


class PromptFit:
    """How many tokens a prompt may have (the context less the completion), and the refusal that
    follows from its byte length alone when even its most compact tokenization could not fit."""

    def __init__(self, *, max_model_len: int, completion_tokens: int, what: str, param: str) -> None:
        self.max_model_len, self.completion_tokens = max_model_len, completion_tokens
        self.what, self.param = what, param

    @property
    def max_prompt_tokens(self) -> int:
        return max(self.max_model_len - self.completion_tokens, 0)

    def check_tokens(self, prompt_len: int, max_tokens: int) -> None:
        """The prompt's tokens and the completion's within the model's context."""
        if prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {self.what}, {max_tokens} "
                f"in the completion). Please reduce the length of the {self.what} or completion.",
                param=self.param,
            )

    def max_bytes(self, model_path: str) -> int | None:
        per_token = max_token_bytes(model_path)
        return None if per_token is None else self.max_prompt_tokens * per_token

    def check_text(self, model_path: str, text: str) -> None:
        max_bytes = self.max_bytes(model_path)
        if max_bytes is None or len(text) * 4 <= max_bytes:
            return  # at most 4 bytes a character: no need to measure
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise self.exceeded(model_path, size)

    def exceeded(self, model_path: str, size: int) -> ContextLengthExceededError:
        per_token = max_token_bytes(model_path) or 1
        at_least = math.ceil(size / per_token)
        completion = f", and the completion needs {self.completion_tokens}" if self.completion_tokens else ""
        return ContextLengthExceededError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, the {self.what} "
            f"({size} bytes) make at least {at_least} tokens of this model (a token stands for at most "
            f"{per_token} bytes){completion}. Please reduce the length of the {self.what}"
            f"{' or completion' if self.completion_tokens else ''}.",
            param=self.param,
        )
