"""Finish decisions: EOS, stop token ids, stop strings, max_tokens, min_tokens.

Stop strings are matched on text, so they can span token boundaries. `StopChecker` keeps the
output text, cuts it at the first stop string (keeping the stop string only when
include_stop_str_in_output), and holds back from streaming any tail that could still be the start
of a stop string, so a client never sees part of one.

`OutputStream` ties an IncrementalDetokenizer, a StopChecker and `check_stop` together in the
order vLLM uses: a token that ends the sequence (EOS, a stop token id) is not rendered unless
include_stop_str_in_output; stop strings are looked for in the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.protocol import FinishReason
from engine.sampling_params import SamplingParams

FINISH_STOP = FinishReason.STOP
FINISH_LENGTH = FinishReason.LENGTH


def check_stop(
    seq_output_token_ids: Sequence[int],
    last_token_id: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    num_output_tokens: int,
    max_model_len_reached: bool,
    *,
    stop_str: str | None = None,
) -> tuple[str | None, int | str | None]:
    """Return (finish_reason, stop_reason) after `last_token_id` was appended.

    finish_reason is "stop" (EOS: stop_reason None; a stop token id: that id; a stop string
    reported by the StopChecker as `stop_str`: that string), "length" (max_tokens or the model's
    context is full), or None to continue. Nothing stops the sequence before min_tokens outputs
    except length. A stop takes precedence over length when both happen on the same token.
    """
    assert num_output_tokens >= 1 and (not seq_output_token_ids or seq_output_token_ids[-1] == last_token_id)
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token_id in eos_token_ids:
            return FINISH_STOP, None
        if last_token_id in params.stop_token_ids:
            return FINISH_STOP, last_token_id
        if stop_str is not None:
            return FINISH_STOP, stop_str
    if num_output_tokens >= params.max_tokens or max_model_len_reached:
        return FINISH_LENGTH, None
    return None, None


class StopChecker:
    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # output text, cut at the stop string once one is found
        self.stop_str: str | None = None  # the stop string found, if any
        self._sent = 0  # chars of self.text already streamed

    @classmethod
    def from_params(cls, params: SamplingParams) -> StopChecker:
        return cls(params.stop, params.include_stop_str_in_output)

    def add_text(self, delta: str, *, check: bool = True) -> str:
        """Append a text delta; return the part of the text now safe to stream.

        With check=False (before min_tokens) the text is kept but not searched; the held-back
        tail still waits, since a stop string completed later may have started in it.
        """
        if self.stop_str is not None:
            return ""
        start = len(self.text)
        self.text += delta
        if check and self.stop and delta:
            self._find_stop(start)
        if self.stop_str is not None:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._partial_stop_len())

    def flush(self) -> str:
        """At finish, for any reason: stream what was held back."""
        return self._release(len(self.text))

    def _find_stop(self, start: int) -> None:
        # Only matches ending in the new delta can be new; back up so one straddling the boundary
        # is found. The match that completes first wins (generation would have stopped there),
        # the longer one on a tie, so the result does not depend on how the text was chunked.
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return
        _, i, s = best
        self.stop_str = s
        self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string.

        Only the last len(stop) - 1 characters can hold one, and only where the stop string's
        first character occurs: the cost does not grow with the output."""
        longest = 0
        for s in self.stop:
            window = self.text[-(len(s) - 1) :] if len(s) > 1 else ""
            i = window.find(s[0])
            while i != -1 and len(window) - i > longest:
                if s.startswith(window[i:]):
                    longest = len(window) - i
                    break
                i = window.find(s[0], i + 1)
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out


@dataclass(slots=True)
class StreamStep:
    text: str  # safe to stream now
    finish_reason: str | None
    stop_reason: int | str | None


class OutputStream:
    """One sequence's output: append each sampled token, get the text delta and finish state."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.params = params
        self.eos_token_ids = list(eos_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stop_checker = StopChecker.from_params(params)
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def output_text(self) -> str:
        return self.stop_checker.text

    def append_token(self, token_id: int, max_model_len_reached: bool = False) -> StreamStep:
        assert self.finish_reason is None, "sequence already finished"
        self.output_token_ids.append(token_id)
        n = len(self.output_token_ids)
        reason, stop_reason = check_stop(
            self.output_token_ids, token_id, self.params, self.eos_token_ids, n, max_model_len_reached
        )
        stopped_by_token = reason == FINISH_STOP
        if stopped_by_token and not self.params.include_stop_str_in_output:
            delta = ""  # the EOS / stop token is not part of the text
        else:
            delta = self.detokenizer.add_tokens([token_id])
        if reason is not None:
            delta += self.detokenizer.flush()
        text = self.stop_checker.add_text(delta, check=n >= self.params.min_tokens and not stopped_by_token)
        if self.stop_checker.stop_str is not None and not stopped_by_token:
            reason, stop_reason = check_stop(
                self.output_token_ids,
                token_id,
                self.params,
                self.eos_token_ids,
                n,
                max_model_len_reached,
                stop_str=self.stop_checker.stop_str,
            )
        if reason is not None:
            text += self.stop_checker.flush()
            self.finish_reason, self.stop_reason = reason, stop_reason
        return StreamStep(text=text, finish_reason=reason, stop_reason=stop_reason)

    def end(self, reason: str) -> str:
        """End the output here though no stop rule fired (its grammar is complete); returns the
        text still held back."""
        assert self.finish_reason is None, "sequence already finished"
        text = self.stop_checker.add_text(self.detokenizer.flush(), check=False) + self.stop_checker.flush()
        self.finish_reason = reason
        return text
