"""Speculative decoding by n-gram prompt lookup: no draft model, drafts copied from the sequence.

Each step, a decoding sequence looks up the longest suffix of its tokens (prompt_lookup_max down
to prompt_lookup_min tokens) that occurred earlier in its prompt or output, and proposes the tokens
that followed that occurrence (up to num_speculative_tokens). The step feeds the last token and the
draft through the model in one forward, batched with everything else, and samples a token at every
position, each from the distribution the sequence would have had there had the draft before it been
accepted. A draft token is accepted while it equals what was sampled at its position; the first
sample that differs is kept in its place, and when all are accepted the sample after the last is a
bonus token. So every step yields 1 to k + 1 tokens.

This is exact. For greedy rows the sample is the argmax, so the output is the one decoding would
give. For sampled rows it is the standard rejection sampling with a draft that puts all its mass on
one token d: accept d with probability p(d), else draw from p with d removed and renormalized;
drawing x ~ p and accepting iff x == d does exactly that (a rejected x is distributed as p given
x != d), so the output distribution is unchanged.

The KV written for rejected draft positions is rolled back by the scheduler: the sequence's
computed length stops after the last accepted token, the blocks past it are freed, and only full
blocks of accepted tokens are ever registered in the prefix cache.

What a sequence may speculate: a row whose logits depend on its own outputs other than through the
model (the repetition, frequency and presence penalties, and min_tokens still pending) does not,
since its draft positions would need that state advanced per position. A constrained row's draft is
cut at the first token its grammar refuses, and the grammar fills a mask for each draft position.
A sequence whose drafts keep being rejected pauses (engine.config.SpeculativeConfig.min_acceptance),
for twice as long each time it fails again, so text without repetition costs next to nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import SpeculativeConfig

# A pause after a window of poor acceptance starts at this many output tokens and doubles up to the
# maximum while acceptance stays poor.
_FIRST_PAUSE = 16
_MAX_PAUSE = 512


def propose_ngram(tokens: array, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram of
    `tokens` (max_n down to min_n tokens); [] when no such suffix occurred before."""
    num = len(tokens)
    if k <= 0 or num < min_n + 1:
        return []
    data = tokens.tobytes()
    width = tokens.itemsize
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        pattern = data[(num - n) * width :]
        end = (num - 1) * width  # the match must start before the suffix itself
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:
                start = at // width + n
                return tokens[start : start + k].tolist()
            end = at + len(pattern) - 1  # a match across token boundaries: look further left
    return []


class SequenceSpeculation:
    """One sequence's lookup buffer and acceptance record."""

    __slots__ = ("tokens", "window_drafted", "window_accepted", "paused_until", "pause")

    def __init__(self) -> None:
        self.tokens = array("i")
        self.window_drafted = 0
        self.window_accepted = 0
        self.paused_until = 0  # output length before which the sequence does not speculate
        self.pause = _FIRST_PAUSE

    def sync(self, token_ids: list[int]) -> array:
        if len(self.tokens) > len(token_ids):  # outputs taken back
            del self.tokens[len(token_ids) :]
        if len(self.tokens) < len(token_ids):
            self.tokens.extend(token_ids[len(self.tokens) :])
        return self.tokens


@dataclass(slots=True)
class SpeculationStats:
    num_drafts: int = 0  # verifications of a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def as_dict(self) -> dict[str, int | float]:
        drafts, drafted = self.num_drafts, self.num_draft_tokens
        return {
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            # Tokens a verification yields on average (the accepted drafts plus the sampled one).
            "spec_mean_accepted_length": 1 + self.num_accepted_tokens / drafts if drafts else 0.0,
        }


def may_speculate(params: Any, num_output_tokens: int) -> bool:
    """Whether a row's sampling is the same at every draft position given the tokens before it:
    no penalty on its own outputs, no min_tokens still pending."""
    return (
        params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and num_output_tokens >= params.min_tokens
    )


class Speculator:
    """The engine's drafts: proposed at schedule time, recorded after verification."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_model: Any = None) -> None:
        """``draft_model``: an engine.draft_model.DraftModel proposing the drafts, or None for
        n-gram lookup."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self._drafts_since_release = 0
        self.stats = SpeculationStats()
        # Cuts a draft to the prefix that a constrained sequence's grammar accepts (set by the
        # engine: its structured outputs); returns that prefix's length.
        self.grammar_prefix: Callable[[Any, list[int]], int] | None = None

    def draft(self, seq: Any, budget: int) -> list[int]:
        """Tokens to verify after seq's last token this step (at most budget); [] for none."""
        cfg = self.config
        params = seq.sampling_params
        num_output = seq.num_output_tokens
        if not may_speculate(params, num_output):
            return []
        state: SequenceSpeculation | None = seq.speculation
        if state is None:
            state = seq.speculation = SequenceSpeculation()
        if num_output < state.paused_until:
            return []
        limit = min(cfg.num_speculative_tokens, budget, self.max_model_len - seq.num_tokens)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - num_output - 1)
        if limit <= 0:
            return []
        if self.draft_model is not None:
            self._drafts_since_release += 1
            if self._drafts_since_release >= 64:  # finished sequences' KV in the draft pool
                self._drafts_since_release = 0
                self.draft_model.release_finished()
            draft = self.draft_model.propose(seq, limit)
        else:
            tokens = state.sync(seq.token_ids)
            draft = propose_ngram(tokens, limit, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if draft and self.grammar_prefix is not None:
            del draft[self.grammar_prefix(seq, draft) :]
        return draft

    def record(self, seq: Any, num_drafted: int, num_accepted: int) -> None:
        """After a verification: count it, and pause a sequence whose drafts keep failing."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        state: SequenceSpeculation = seq.speculation
        state.window_drafted += num_drafted
        state.window_accepted += num_accepted
        if state.window_drafted < self.config.acceptance_window:
            return
        if state.window_accepted < self.config.min_acceptance * state.window_drafted:
            state.paused_until = seq.num_output_tokens + state.pause
            state.pause = min(2 * state.pause, _MAX_PAUSE)
        else:
            state.pause = _FIRST_PAUSE
        state.window_drafted = state.window_accepted = 0


def accepted_tokens(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification yields: the draft's prefix that matches the samples at its
    positions, then the first sample that differs (or the bonus sample after a full match)."""
    assert len(sampled) == len(draft) + 1
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return sampled[: n + 1]
