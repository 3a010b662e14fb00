"""Offline API: ``LLM(model_dir).generate(prompts, SamplingParams(...))`` runs a batch to completion."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from engine.chat_template import chat_prompt_token_ids
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

_CACHE_FIELDS = {
    "block_size",
    "num_blocks",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "enable_prefix_caching",
}
_SCHEDULER_FIELDS = {
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "max_prefill_tokens_with_decodes",
    "policy",
    "max_seqs_per_request",
    "fair_preempt_tokens_per_step",
    "shared_step_slowdown",
    "decode_fixed_rows",
    "prompt_token_rows",
    "decode_key_rows",
    "prompt_key_rows",
    "prompt_logprob_rows",
}


def engine_config_from_kwargs(model: str, **kwargs: Any) -> EngineConfig:
    """Flat keyword arguments, vLLM style, sorted into the nested engine config."""
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS}
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHEDULER_FIELDS}
    if kwargs.get("max_model_len") is not None:
        sched.setdefault("max_model_len", kwargs["max_model_len"])
        if not sched.get("enable_chunked_prefill", True):
            sched.setdefault("max_num_batched_tokens", max(kwargs["max_model_len"], 2048))
    return EngineConfig(
        model=str(model), cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **kwargs
    )


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config_from_kwargs(model, **engine_kwargs))
        self._counter = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Final outputs in the order of ``prompts`` (strings are tokenized with special tokens)."""
        batch: Seq[str | Seq[int]] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else prompts
        )
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_lists, sampling_params)

    def chat(
        self,
        messages: Seq[dict[str, str]] | Seq[Seq[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the assistant prompt) to each conversation, then generate."""
        conversations: Seq[Seq[dict[str, str]]] = (
            [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[list-item,assignment]
        )
        token_lists = [chat_prompt_token_ids(self.tokenizer, conv) for conv in conversations]
        return self._run(token_lists, sampling_params)

    def _run(
        self, token_lists: list[list[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(token_lists)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(token_lists):
            raise ValueError(f"{len(token_lists)} prompts but {len(params)} sampling params")
        ids = []
        for tokens, p in zip(token_lists, params, strict=True):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, tokens, p)
            ids.append(request_id)
        final: dict[str, RequestOutput] = {}
        # Step outputs carry only each step's logprobs; the final outputs get the whole list.
        logprobs: dict[tuple[str, int], list] = {}
        prompt_logprobs: dict[str, list] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                for c in out.outputs:
                    if c.logprobs_delta is not None:
                        logprobs.setdefault((out.request_id, c.index), []).extend(c.logprobs_delta)
                if out.finished:
                    final[out.request_id] = out
        for request_id, out in final.items():
            out.prompt_logprobs = prompt_logprobs.get(request_id, out.prompt_logprobs)
            for c in out.outputs:
                if c.logprobs_delta is not None:
                    c.logprobs = logprobs.get((request_id, c.index), [])
        return [final[i] for i in ids]
