"""A request into the engine (LLMEngine.add_request): every field that arrives from outside checked, and refused with a
typed error before any state changes; its grammar acquired and its adapter loaded; its sequences
built (one per `n`), brought to where a lost replica had them when it is resumed (engine.resume),
and handed to the scheduler, or to the grammar waits while its grammar compiles."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from engine.errors import EngineError, InvalidRequestError
from engine.lora.errors import LoRADisabledError
from engine.protocol import FinishReason, LoRARef
from engine.request_state import STATUS_OF_FINISH, Completion, EngineRequest, check_request_fields
from engine.resume import Resume, replay
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.stop_checker import OutputStream
from engine.structured_output.compiler import CompileJob
from engine.structured_output.manager import WaitingGrammar

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def add_request(
    engine: LLMEngine,
    request_id: str,
    prompt_token_ids: Seq[int],
    sampling_params: SamplingParams,
    *,
    tenant: str = "",
    priority: int = 0,
    cache_salt: str | None = None,
    lora: LoRARef | None = None,
    weight: float = 1.0,
    deadline: float | None = None,
    resume: Resume | None = None,
) -> None:
    """Queue a request; ``lora`` (name, path, version) names an adapter of ``tenant``, or None
    for the base model. ``weight`` is the tenant's fair-share weight; ``deadline`` the unix time
    by which the request must have started, else it is dropped (queue_timeout). ``resume``: a
    request taken over from a lost replica, continued from what it had streamed (engine.resume);
    it has started already, so no queue deadline applies."""
    check_request_fields(request_id, sampling_params, tenant, cache_salt, priority, weight, deadline)
    if request_id in engine._requests:
        raise InvalidRequestError(f"request id {request_id!r} is already in use")
    engine.scheduler.check_num_seqs(sampling_params.n)  # before a grammar waits outside the scheduler
    prompt = _checked_token_ids(engine, prompt_token_ids, "prompt")
    if resume is not None:
        sampling_params = resume.sampling_params(sampling_params)
        for tokens in resume.outputs:
            _checked_token_ids(engine, tokens, "resumed output")
        deadline = None
    grammar: CompileJob | None = None
    if sampling_params.structured_outputs is not None:
        grammar = engine.grammars.acquire(
            sampling_params.structured_outputs,
            tenant=tenant,
            cache_salt=cache_salt,
            n=sampling_params.n,
            deadline=None if deadline is None else float(deadline),
        )
    try:
        lora_id = _lora_id(engine, tenant, lora, sampling_params.n)
    except BaseException:
        if grammar is not None:
            engine.grammars.manager.release(grammar)
        raise
    now = time.time()
    # The first add carries every size check; siblings are identical, so they cannot fail after it.
    added: list[Sequence] = []
    try:
        completions = [
            Completion(
                Sequence(
                    request_id,
                    prompt,
                    sampling_params,
                    index=i,
                    tenant=tenant,
                    priority=priority,
                    cache_salt=cache_salt,
                    lora_id=lora_id,
                    arrival_time=now,
                    weight=float(weight),
                    deadline=None if deadline is None else float(deadline),
                ),
                OutputStream(engine.tokenizer, prompt, sampling_params, engine.eos_token_ids),
            )
            for i in range(sampling_params.n)
        ]
        if resume is not None:
            for c in completions:
                replay(c, resume.outputs[c.seq.index], engine.max_model_len)
        seqs = [c.seq for c in completions if c.finish_reason is None]
        # A grammar still compiling: the request waits outside the scheduler until it is ready
        # (decided once: the compile thread may finish at any moment).
        compiled = grammar is None or grammar.future.done()
        for seq in seqs if compiled else ():
            engine.scheduler.add(seq)
            added.append(seq)
    except EngineError:
        for seq in added:
            engine.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED, FinishReason.ABORT)
        if engine.lora_manager is not None and lora_id:
            engine.lora_manager.release(lora_id, sampling_params.n)
        if grammar is not None:
            engine.grammars.manager.release(grammar)
        raise
    for c in completions:
        c.logprobs_delta = None if sampling_params.logprobs is None else []
        if sampling_params.logprobs is not None:
            c.cumulative_logprob = 0.0
        engine._completions[c.seq.seq_id] = c
    engine._requests[request_id] = EngineRequest(
        request_id,
        completions,
        len(prompt),
        prompt_logprobs_due=sampling_params.prompt_logprobs is not None,
    )
    engine.num_prompt_tokens += len(prompt)
    if resume is not None:
        engine.num_resumed_requests += 1
        engine.num_resumed_tokens += resume.num_tokens
    for c in completions:
        if c.finish_reason is not None:  # ended on the lost replica: not run again
            c.seq.status = STATUS_OF_FINISH[c.finish_reason]
            engine.finish_completion(c.seq, c.finish_reason, c.stop_reason)
    if not seqs:
        engine._ended_at_add[request_id] = None  # reported by the next step
    if grammar is not None:
        if compiled:
            engine.grammars.bind(seqs, grammar)
            engine.grammars.manager.release(grammar)
        else:
            engine.grammars.waiting[request_id] = WaitingGrammar(
                grammar, None if deadline is None else float(deadline)
            )


def _checked_token_ids(engine: LLMEngine, token_ids: Seq[int], what: str) -> list[int]:
    tokens = list(token_ids)
    bad = [
        t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < engine.vocab_size
    ]
    if bad:
        raise InvalidRequestError(f"{what} token ids out of range [0, {engine.vocab_size}): {bad[:5]}")
    return tokens


def _lora_id(engine: LLMEngine, tenant: str, lora: LoRARef | None, num_seqs: int) -> int:
    if lora is None:
        return 0
    if engine.lora_manager is None:
        raise LoRADisabledError("LoRA adapters are not enabled on this engine")
    # Keyed by tenant: one tenant's adapter name never resolves to another tenant's weights.
    return engine.lora_manager.add_adapter((tenant, lora.name, lora.version), lora.path, num_seqs=num_seqs)
