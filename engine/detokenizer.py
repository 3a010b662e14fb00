"""Incremental detokenization: token ids in, text deltas out, never half a character.

The prefix/read offset technique of vLLM's detokenize_incrementally (and of tokenizers'
DecodeStream): decode only a short window of ids — a few already-emitted ids for context
(`prefix_offset`..`read_offset`) plus the new ones — and emit what the new ids add to the
window's text. The context makes leading spaces and merges render as they do in a full decode;
the window keeps the cost per token constant instead of re-decoding the whole output.

While the window's text ends in U+FFFD the last ids hold an incomplete UTF-8 sequence (a byte
token of an emoji or CJK character); nothing is emitted until it completes. `flush()` releases
whatever is still held when the sequence finishes.

Works with a `tokenizers.Tokenizer` and a transformers fast tokenizer alike (only `decode` is
used). The concatenated deltas equal `decode(output_ids, skip_special_tokens=...)` without
transformers' `clean_up_tokenization_spaces`, which rewrites text across token boundaries and so
cannot be streamed. The first output ids are decoded after the prompt's last ids, as vLLM does,
so a tokenizer that strips the leading space of a decode (SentencePiece) keeps it here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt ids kept as decoding context for the first output ids (vLLM's value).
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def decode(tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """`tokenizer.decode` without transformers' space clean-up, for either tokenizer kind."""
    ids = list(token_ids)
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # a transformers tokenizer
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Context ids then output ids; offsets index into this list.
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        # A prompt ending in half a character would glue its bytes to the first output bytes and
        # render differently from the output decoded alone; context must end on a whole character.
        while context and decode(tokenizer, context, skip_special_tokens).endswith(_REPLACEMENT):
            context.pop()
        self._ids: list[int] = context
        self._num_context = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        self.output_text = ""  # everything emitted so far

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: Sequence[int]) -> str:
        return decode(self.tokenizer, ids, self.skip_special_tokens)

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append output ids; return the text they complete ('' while a character is partial)."""
        self._ids.extend(new_token_ids)
        if self.read_offset == len(self._ids):
            return ""
        text = self._decode(self._ids[self.prefix_offset :])
        if text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text):
            # An incomplete UTF-8 tail, or ids that render as nothing yet (skipped specials,
            # a byte token whose text only appears with the next one): wait for more.
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """At finish: emit what is still held, replacement characters included."""
        if self.read_offset == len(self._ids):
            return ""
        text = self._decode(self._ids[self.prefix_offset :])
        if len(text) <= len(self._prefix_text):
            self.read_offset = len(self._ids)
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # The new window starts where the old read offset was: those ids rendered completely,
        # so their decode is exactly the text just emitted (from its last token boundary).
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        self.output_text += delta
        return delta
