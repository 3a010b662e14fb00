"""What a step's sampled tokens make of each request: a token appended to its completion (through
the grammar's matcher, the detokenizer and the stop checker), a completion finished and its
resources released, a failed forward ending the requests of its batch, and the per-request outputs
the engine reports."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from engine.outputs import RequestOutput
from engine.protocol import ErrorCode, FinishReason
from engine.request_state import STATUS_OF_FINISH
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.stop_checker import StreamStep

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger("engine.llm_engine")


class OutputProcessor:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[Any]) -> None:
        """A step's new tokens of seq (already on it; several when a draft was accepted), each
        through its grammar, detokenizer and stop checker. Tokens after one that ends the output
        are taken back off the sequence."""
        for i, token in enumerate(tokens):
            self._append(seq, token, logprobs[i], seq.num_tokens - (len(tokens) - 1 - i))
            if seq.is_finished:
                seq.drop_last_outputs(len(tokens) - 1 - i)
                return

    def _append(self, seq: Sequence, token: int, logprobs: Any, num_tokens: int) -> None:
        e = self.engine
        c = e._completions[seq.seq_id]
        e.num_generated_tokens += 1
        accepted, terminated = e.grammars.accept(seq.seq_id, token)
        if not accepted:  # the bitmask allows only what the grammar accepts: an engine bug
            req = e._requests[seq.request_id]
            req.error, req.error_code = "the output left its grammar", ErrorCode.ENGINE_ERROR
            e.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, FinishReason.ERROR)
            self.finish(seq, FinishReason.ERROR, None)
            return
        step = c.stream.append_token(token, max_model_len_reached=num_tokens >= e.max_model_len)
        if terminated and step.finish_reason is None:
            # The grammar is complete and allows nothing more (its end token was not a stop, as
            # with ignore_eos): the output ends here.
            step = StreamStep(step.text + c.stream.end(FinishReason.STOP), FinishReason.STOP, None)
        c.text += step.text
        c.text_delta += step.text
        c.token_ids_delta.append(token)
        if logprobs is not None and c.logprobs_delta is not None:
            c.logprobs_delta.append(logprobs)
            c.cumulative_logprob = (c.cumulative_logprob or 0.0) + logprobs.logprob
        if step.finish_reason is not None:
            e.scheduler.finish(seq, STATUS_OF_FINISH[step.finish_reason], step.finish_reason)
            self.finish(seq, step.finish_reason, step.stop_reason)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        e = self.engine
        c = e._completions.pop(seq.seq_id)
        c.finish_reason, c.stop_reason = reason, stop_reason
        e.runner.free(seq.seq_id)
        e.grammars.release(seq.seq_id)
        if seq.lora_id and e.lora_manager is not None:
            e.lora_manager.release(seq.lora_id)

    def fail(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        e = self.engine
        failed: dict[str, None] = {}
        for item in sched_out.scheduled:
            failed[item.seq.request_id] = None
        # The batch holds other tenants' requests: the detail (which may quote one request's input)
        # goes to the log, each request gets the same generic message.
        logger.error("a forward failed; ending the %d requests of its batch", len(failed), exc_info=exc)
        for request_id in failed:
            req = e._requests[request_id]
            req.error = "the engine failed while running this request's batch"
            req.error_code = ErrorCode.ENGINE_ERROR
            for c in req.completions:
                if c.finish_reason is None:
                    e.scheduler.finish(c.seq, SequenceStatus.FINISHED_ERROR, FinishReason.ERROR)
                    self.finish(c.seq, FinishReason.ERROR, None)
        return self.outputs(failed)

    def outputs(self, request_ids: dict[str, None]) -> list[RequestOutput]:
        e = self.engine
        outputs = []
        for request_id in request_ids:
            req = e._requests[request_id]
            outputs.append(req.output())
            if req.finished:
                del e._requests[request_id]
        return outputs
