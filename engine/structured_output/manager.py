"""Grammars compiled for the engine's tokenizer, off the step loop, and a matcher per sequence.

A request with a constraint waits (outside the scheduler) until its grammar is compiled; the
compile runs in a thread of its own (xgrammar releases the GIL while it compiles), so a slow schema
delays only its own request. Compiled grammars are cached per spec, least recently used first out.
Each step, the constrained sequences' matchers fill one int32 bitmask row each (bit j of word w:
token 32 * w + j is allowed); free rows allow everything, and the sampler masks the batch at once.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from engine.structured_output.grammar import build_grammar
from engine.structured_output.spec import spec_key

# Compiled grammars kept per engine: a JSON schema's is typically tens of KiB to a few MiB.
DEFAULT_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        # One compiler thread: compiles are rare next to steps, and the engine's cores are the
        # forward's. Our cache, not xgrammar's: it also holds compiles in flight and their errors.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # Seconds per compile, newest last (the benchmark reads them).
        self.compile_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        self.num_cache_hits = 0

    def grammar(self, spec: dict[str, Any]) -> Future:
        """The compiled grammar of a canonical spec, as a future (done at once on a cache hit);
        its exception is a StructuredOutputsError when the spec cannot be compiled."""
        key = spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # a waiting request holds its own future
            return future

    def _compile(self, spec: dict[str, Any]) -> Any:
        started = time.perf_counter()
        compiled = self.compiler.compile_grammar(build_grammar(spec))
        self.compile_seconds.append(time.perf_counter() - started)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(self, matchers: Sequence[Any | None]) -> torch.Tensor | None:
        """(len(matchers), num_words) int32 of allowed tokens, all bits set for a None (a free
        row); None when no row is constrained."""
        if all(m is None for m in matchers):
            return None
        mask = torch.full((len(matchers), self.num_words), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, i)
        return mask

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarRequests:
    """The engine's structured-output bookkeeping: requests waiting for their grammar, and the
    matcher of each constrained sequence. The manager is built on the first constrained request,
    so an engine that never sees one never loads the tokenizer's grammar tables."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._args = (tokenizer, vocab_size, list(eos_token_ids))
        self._manager: StructuredOutputManager | None = None
        self.waiting: dict[str, Future] = {}  # request_id -> its grammar, still compiling
        self.matchers: dict[int, Any] = {}  # seq_id -> matcher

    @property
    def manager(self) -> StructuredOutputManager:
        if self._manager is None:
            tokenizer, vocab_size, eos = self._args
            self._manager = StructuredOutputManager(tokenizer, vocab_size=vocab_size, eos_token_ids=eos)
        return self._manager

    def bind(self, seq_ids: Sequence[int], compiled: Any) -> None:
        for seq_id in seq_ids:
            self.matchers[seq_id] = self.manager.matcher(compiled)

    def done(self) -> list[str]:
        """Waiting requests whose grammar is compiled (or failed), in arrival order."""
        return [rid for rid, future in self.waiting.items() if future.done()]

    def wait(self, timeout: float) -> None:
        """Block until a waiting grammar is done or `timeout` passes: an engine with nothing else to
        run must not spin."""
        if self.waiting:
            wait_futures(list(self.waiting.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def bitmask(self, seqs: Sequence[Any]) -> torch.Tensor | None:
        if not self.matchers:
            return None
        return self.manager.bitmask([self.matchers.get(s.seq_id) for s in seqs])

    def accept(self, seq_id: int, token: int) -> tuple[bool, bool]:
        """(accepted, terminated) of a sampled token; (True, False) for a free sequence."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return True, False
        return bool(matcher.accept_token(token)), bool(matcher.is_terminated())

    def release(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
