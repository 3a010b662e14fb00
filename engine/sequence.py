"""Per-sequence state: the tokens, how many of them have KV in the cache, and the blocks holding it."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from engine.errors import EngineError, InvalidRequestError, RequestTooLargeError

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "RequestTooLargeError",
    "Sequence",
    "SequenceStatus",
]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # also where a preempted sequence returns
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    }
)

# seq_id must be unique across every request this process ever sees, since the runner and the
# sampler key their per-step state by it.
_seq_ids = itertools.count()


class Sequence:
    """One generated continuation of a request; a request with n > 1 has n of them (index 0..n-1)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        *,
        index: int = 0,
        tenant: str = "",
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int = 0,
        arrival_time: float | None = None,
        weight: float = 1.0,
        deadline: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt must contain at least one token")
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + output kept as one list so block hashing can slice it without concatenating.
        self._token_ids = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # The windowed layers' blocks (models with a KV window, engine.block_manager): one entry per
        # entry of block_table, NO_BLOCK where the block fell out of the window and was freed.
        self.window_block_table: list[int] = []
        # Chained content hashes of this sequence's full blocks; tokens of a full block never change
        # (preemption keeps the outputs), so they are computed once and survive preemption.
        self.block_hashes: list[bytes] = []
        self.tenant = tenant
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # The tenant's fair-share weight, and the unix time by which the request must have started
        # (None: it waits as long as it takes); both the same for every sequence of a request.
        self.weight = weight
        self.deadline = deadline
        self.num_prompt_tokens_charged = 0  # prompt positions already counted as service
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # Logprobs of prompt tokens 1.. (the first has none), when the request asked for them.
        self.prompt_logprobs: list = []
        # The sampler's bias and penalty state of this request (engine.sampling_state), shared with
        # its siblings and grown as it generates; built when it first samples.
        self.sampling_state: Any = None
        # Its n-gram lookup buffer and draft acceptance (engine.speculative), when the engine
        # speculates; built when it first decodes.
        self.speculation: Any = None
        # The scheduler's step that last decoded it (engine.step_width: who takes turns first).
        self.last_decode_step = -1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: asked for (by the request's first sequence only: its
        siblings share the prompt) and not all computed yet."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, index={self.index}, "
            f"status={self.status.name}, tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read-only: grow it with append_token."""
        return self._token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def max_tokens(self) -> int | None:
        return getattr(self.sampling_params, "max_tokens", None)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet: what the next steps must feed through the model."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill(self) -> bool:
        """True while tokens other than the last one still lack KV (a prompt, or a recompute after
        preemption). A decode step feeds exactly the last token, so it is not a prefill."""
        return self.num_computed_tokens < self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        self._token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def drop_last_outputs(self, n: int) -> None:
        """Forget the last n outputs of a finished sequence: a step that yielded several tokens
        (speculative decoding) whose output ended before the last of them."""
        assert self.is_finished and 0 <= n <= self.num_output_tokens
        if n:
            del self._token_ids[-n:]
            del self.output_token_ids[-n:]
