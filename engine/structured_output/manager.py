"""Grammars compiled for the engine's tokenizer, off the step loop, and a matcher per sequence.

A request with a constraint waits (outside the scheduler) until its grammar is compiled, in a compile
process of the replica's pool (engine.structured_output.compiler: bounded per replica and per tenant,
with a timeout; a compile nobody waits for any more is killed). Its deadline applies while it waits.
Compiled grammars are cached per tenant (and cache salt), so one tenant cannot tell by timing which
schemas another used, and bounded by bytes, least recently used first out.

Each step, the constrained sequences' masks are filled together by xgrammar's batch matcher (its own
threads, the GIL released), in a thread of ours while the model's forward runs: one int32 row per
sampled sequence (bit j of word w: token 32 * w + j is allowed), free rows allowing everything.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.config import StructuredOutputConfig
from engine.errors import InvalidRequestError
from engine.protocol import ErrorCode
from engine.structured_output.compiler import CompileJob, CompilePool, GrammarCompileError
from engine.structured_output.spec import spec_key

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        config: StructuredOutputConfig | None = None,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.config = config or StructuredOutputConfig()
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.pool = CompilePool(self.info, self.config)
        threads: int | Literal["auto"] = self.config.mask_threads or "auto"
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        # (namespace, spec key) -> its job, in flight or done; done ones count their bytes.
        self._cache: collections.OrderedDict[tuple[str, str], CompileJob] = collections.OrderedDict()
        self.cache_bytes = 0
        # Reentrant: a job that finished before its done callback was added runs it at once.
        self._lock = threading.RLock()
        self.num_cache_hits = 0
        self.num_mask_fills = 0  # batched fills (one per step with a constrained sequence)

    @property
    def compile_seconds(self) -> collections.deque[float]:
        return self.pool.compile_seconds

    def grammar(
        self,
        spec: dict[str, Any],
        *,
        tenant: str = "",
        cache_salt: str | None = None,
        deadline: float | None = None,
    ) -> CompileJob:
        """The compile job of a canonical spec for this tenant (its future done at once on a cache
        hit; its exception a GrammarCompileError). The caller holds it until `release`, and waits
        for it until `deadline` (unix time; None: as long as it takes): a compile that no request
        still waits for when a slot comes to it is never started."""
        key = (f"{tenant}\x00{cache_salt or ''}", spec_key(spec))
        with self._lock:
            job = self._cache.get(key)
            if job is not None and not job.future.done() and not self.pool.extend_deadline(job, deadline):
                del self._cache[key]  # dropped unstarted: its requests expire; this one compiles anew
                job = None
            if job is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
            else:
                job = self.pool.submit(key, spec, tenant, deadline)
                self._cache[key] = job
                job.future.add_done_callback(functools.partial(self._on_done, job))
            job.waiters += 1
            return job

    def release(self, job: CompileJob) -> None:
        """A request stops waiting for the job: a compile nobody waits for is cancelled (killed)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters or job.future.done():
                return
            if self._cache.get(job.key) is job:
                del self._cache[job.key]
        self.pool.cancel(job)

    def _on_done(self, job: CompileJob, _: Future) -> None:
        self._done(job)

    def _done(self, job: CompileJob) -> None:
        if job.future.cancelled():
            return
        error = job.future.exception()
        with self._lock:
            if self._cache.get(job.key) is not job:
                return
            job.nbytes = (
                len(job.key[1]) + len(job.key[0]) + (0 if error else job.future.result().memory_size_bytes)
            )
            self.cache_bytes += job.nbytes
            while self.cache_bytes > self.config.cache_bytes and self._cache:
                oldest = next((j for j in self._cache.values() if j.future.done()), None)
                if oldest is None:
                    break
                del self._cache[oldest.key]
                self.cache_bytes -= oldest.nbytes

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(
        self, matchers: Sequence[Any | None], prefixes: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor | None:
        """(len(matchers), num_words) int32 of allowed tokens, all bits set for a None (a free
        row); None when no row is constrained. One batched fill for the constrained rows; a row
        with a prefix (draft tokens before its position, speculative decoding) is filled after its
        matcher accepts the prefix, which it then rolls back."""
        constrained = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            return None
        mask = torch.full((len(matchers), self.num_words), -1, dtype=torch.int32)
        batch = [(i, m) for i, m in constrained if prefixes is None or not prefixes[i]]
        if batch:
            rows = [i for i, _ in batch]
            self._batch.batch_fill_next_token_bitmask([m for _, m in batch], mask, rows)
        if prefixes is not None:
            for i, matcher in constrained:
                prefix = prefixes[i]
                if not prefix:
                    continue
                for token in prefix:
                    accepted = matcher.accept_token(token)
                    assert accepted, "a draft is cut to what its grammar accepts"
                matcher.fill_next_token_bitmask(mask, i)
                matcher.rollback(len(prefix))
        self.num_mask_fills += 1
        return mask

    def start_bitmask(
        self, matchers: Sequence[Any | None], prefixes: Sequence[Sequence[int]] | None = None
    ) -> Future | None:
        """`bitmask` in the mask thread (the caller runs the forward meanwhile); None when no row
        is constrained."""
        if all(m is None for m in matchers):
            return None
        return self._filler.submit(self.bitmask, list(matchers), prefixes)

    def shutdown(self) -> None:
        self.pool.shutdown()
        self._filler.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class WaitingGrammar:
    job: CompileJob
    deadline: float | None  # the request's queue deadline (unix time), which applies while it waits


class GrammarRequests:
    """The engine's structured-output bookkeeping: requests waiting for their grammar, and the
    matcher of each constrained sequence. The manager is built on the first constrained request,
    so an engine that never sees one never loads the tokenizer's grammar tables."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        config: StructuredOutputConfig | None = None,
    ) -> None:
        self._args = (tokenizer, vocab_size, list(eos_token_ids))
        self.config = config or StructuredOutputConfig()
        self._manager: StructuredOutputManager | None = None
        self.waiting: dict[str, WaitingGrammar] = {}  # request_id -> its grammar, still compiling
        self.matchers: dict[int, Any] = {}  # seq_id -> matcher
        # seq_id -> draft tokens (speculative decoding) its grammar may check per step: each costs
        # a mask, and one request's masks per step stay within max_request_mask_ms.
        self.draft_room: dict[int, int] = {}

    @property
    def manager(self) -> StructuredOutputManager:
        if self._manager is None:
            tokenizer, vocab_size, eos = self._args
            self._manager = StructuredOutputManager(
                tokenizer, vocab_size=vocab_size, eos_token_ids=eos, config=self.config
            )
        return self._manager

    def check_request_cost(self, job: CompileJob, n: int) -> None:
        """Refuse (grammar_too_costly) a request whose n masks per step would together take more
        CPU time than max_request_mask_ms: each sequence pays a token per step, and the step waits
        for every mask."""
        limit = self.config.max_request_mask_ms
        if job.mask_ms * n > limit:
            raise GrammarCompileError(
                f"The structured output grammar is too costly to enforce for {n} sequences: its token"
                f" masks take up to {job.mask_ms:.1f} ms of CPU time each, {job.mask_ms * n:.0f} ms per"
                f" step for this request, above this engine's limit of {limit:g} ms"
                " (max_request_mask_ms). Lower n, or bound strings less widely.",
                ErrorCode.GRAMMAR_TOO_COSTLY,
            )

    def acquire(
        self,
        spec: dict[str, Any],
        *,
        tenant: str,
        cache_salt: str | None,
        n: int,
        deadline: float | None = None,
    ) -> CompileJob:
        """The compile job of a request's grammar (cached per tenant and salt: one tenant never
        learns by timing what another compiled), held for the request until released. A grammar
        already known to fail, or to cost more than the replica allows for n sequences, is
        refused (InvalidRequestError) and not held."""
        job = self.manager.grammar(spec, tenant=tenant, cache_salt=cache_salt, deadline=deadline)
        if not job.future.done():
            return job
        try:
            error = job.future.exception()
            if error is not None:
                raise error if isinstance(error, InvalidRequestError) else InvalidRequestError(str(error))
            self.check_request_cost(job, n)
        except InvalidRequestError:
            self.manager.release(job)
            raise
        return job

    def bind(self, seqs: Sequence[Any], job: CompileJob) -> None:
        """A matcher per sequence of the job's compiled grammar, advanced through the outputs it
        already has (a request resumed from a lost replica's stream)."""
        compiled = job.future.result()
        cost = job.mask_ms * len(seqs)
        masks = int(self.config.max_request_mask_ms // cost) if cost > 0 else 1 << 30
        for seq in seqs:
            matcher = self.matchers[seq.seq_id] = self.manager.matcher(compiled)
            self.draft_room[seq.seq_id] = max(0, masks - 1)
            for token in seq.output_token_ids:
                if not matcher.accept_token(token):
                    logger.error(
                        "a resumed output token %d left its grammar (request %s)", token, seq.request_id
                    )
                    break

    def draft_prefix(self, seq: Any, draft: list[int]) -> int:
        """How many leading tokens of a draft the sequence's grammar accepts (all of them for a
        free sequence), within its room for masks; the matcher is left as it was."""
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            return len(draft)
        room = min(len(draft), self.draft_room.get(seq.seq_id, 0))
        n = 0
        while n < room and not matcher.is_terminated() and matcher.accept_token(draft[n]):
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def done(self) -> list[str]:
        """Waiting requests whose grammar is compiled (or failed), in arrival order."""
        return [rid for rid, w in self.waiting.items() if w.job.future.done()]

    def expired(self, now: float) -> list[str]:
        """Waiting requests whose deadline has passed, their grammar not done."""
        return [
            rid
            for rid, w in self.waiting.items()
            if w.deadline is not None and now >= w.deadline and not w.job.future.done()
        ]

    def take(self, request_id: str) -> CompileJob | None:
        """Stop waiting for a request's grammar (its compile cancelled when nobody else waits)."""
        waiting = self.waiting.pop(request_id, None)
        if waiting is None:
            return None
        self.manager.release(waiting.job)
        return waiting.job

    def wait(self, timeout: float) -> None:
        """Block until a waiting grammar is done or `timeout` passes: an engine with nothing else to
        run must not spin."""
        if self.waiting:
            futures = [w.job.future for w in self.waiting.values()]
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def start_bitmask(
        self, seqs: Sequence[Any], prefixes: Sequence[Sequence[int]] | None = None
    ) -> Callable[[], torch.Tensor | None] | None:
        """Start filling the masks of a step's sampled rows (each a sequence, after the draft
        tokens of its prefix); returns the join (None when no row is constrained)."""
        if not self.matchers:
            return None
        future = self.manager.start_bitmask([self.matchers.get(s.seq_id) for s in seqs], prefixes)
        return None if future is None else future.result

    def accept(self, seq_id: int, token: int) -> tuple[bool, bool]:
        """(accepted, terminated) of a sampled token; (True, False) for a free sequence."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return True, False
        return bool(matcher.accept_token(token)), bool(matcher.is_terminated())

    def release(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self.draft_room.pop(seq_id, None)
