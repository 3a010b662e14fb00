"""Requests waiting outside the scheduler for their structured-output grammar to compile: each step
they are admitted once it is ready, or end when it failed, cost too much, their deadline passed
while it compiled, or they were aborted meanwhile."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.protocol import ErrorCode, FinishReason
from engine.request_state import compile_error
from engine.scheduler import FINISH_QUEUE_TIMEOUT
from engine.sequence import SequenceStatus
from engine.structured_output.spec import StructuredOutputsError

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class GrammarWaits:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._aborted: dict[str, None] = {}  # aborted while their grammar compiled

    def abort(self, request_id: str) -> bool:
        """Whether the request waits for its grammar (its compile is cancelled at the next step)."""
        if request_id not in self.engine.grammars.waiting:
            return False
        self._aborted[request_id] = None
        return True

    def step(self) -> dict[str, None]:
        """The requests that ended this step."""
        ended = self._take_aborted()
        ended.update(self._admit_compiled())
        ended.update(self._expire())
        return ended

    def _take_aborted(self) -> dict[str, None]:
        engine = self.engine
        ended: dict[str, None] = {}
        for request_id in list(self._aborted):
            del self._aborted[request_id]
            if engine.grammars.take(request_id) is None:
                continue
            for c in engine.request(request_id).completions:
                engine.finish_completion(c.seq, FinishReason.ABORT, None)
            ended[request_id] = None
        return ended

    def _admit_compiled(self) -> dict[str, None]:
        """Requests whose grammar finished compiling go to the scheduler (or fail); returns those
        that ended."""
        engine = self.engine
        ended: dict[str, None] = {}
        for request_id in engine.grammars.done():
            job = engine.grammars.take(request_id)
            assert job is not None  # done() lists only requests that wait for a grammar
            future = job.future
            req = engine.request(request_id)
            # Not those that a resumed request had finished on its lost replica.
            seqs = [c.seq for c in req.completions if c.finish_reason is None]
            error = compile_error(future)
            if error is None:
                try:
                    engine.grammars.check_request_cost(job, len(seqs))
                except EngineError as exc:
                    error = exc
            if error is None:
                try:
                    for seq in seqs:
                        engine.scheduler.add(seq)
                except EngineError as exc:
                    for seq in seqs:
                        engine.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, FinishReason.ERROR)
                    error = exc
            if error is None:
                engine.grammars.bind(seqs, job)
                continue
            req.error = str(error)
            req.error_code = getattr(error, "code", None) or (
                ErrorCode.INVALID_REQUEST
                if isinstance(error, StructuredOutputsError)
                else ErrorCode.ENGINE_ERROR
            )
            for seq in seqs:
                engine.finish_completion(seq, FinishReason.ERROR, None)
            ended[request_id] = None
        return ended

    def _expire(self) -> dict[str, None]:
        """Requests whose deadline passed while their grammar compiled end: dropped unbilled
        (queue_timeout) when the compile had not started, billed (grammar_compile_timeout) when it
        had; a compile that no request waits for any more is killed."""
        engine = self.engine
        ended: dict[str, None] = {}
        for request_id in engine.grammars.expired(time.time()):
            job = engine.grammars.take(request_id)
            assert job is not None
            req = engine.request(request_id)
            if job.started:
                req.error = "the request's deadline passed while its structured output grammar compiled"
                req.error_code = ErrorCode.GRAMMAR_COMPILE_TIMEOUT
            else:
                req.error = (
                    "the request waited in the queue past its deadline and was dropped before it started"
                )
                req.error_code = FINISH_QUEUE_TIMEOUT
            for c in req.completions:
                engine.finish_completion(c.seq, FinishReason.ERROR, None)
            ended[request_id] = None
        return ended
