"""The engine of an embedding replica: an encoder model (engine.models.bert), or a decoder of the
Llama family run causally over each input (LlamaForCausalLM.encode, for the embedding models built
on decoders), with no KV cache, and a scheduler whose one step kind is a packed prefill-only batch.

A request holds up to thousands of inputs; each step packs inputs, in the waiting order, up to
`max_num_batched_tokens` tokens and `max_num_seqs` inputs (one longer input runs alone), runs the
encoder once over all of them and pools each. The waiting order is the generation scheduler's
(engine.request_queue): priority tier, then weighted fair share of service across tenants
(engine.fair_share; an input's tokens are its service), then arrival, so one tenant's corpus does
not hold the replica while another's query waits. A request whose deadline passes before its first
input runs ends with queue_timeout, as a generation does. It answers the worker as LLMEngine does
(add, abort, step, load), with each finished request's embeddings in `RequestOutput.embeddings`.
"""

from __future__ import annotations

import base64
import functools
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError, EngineConfig
from engine.errors import InvalidRequestError, RequestTooLargeError
from engine.fair_share import ServiceCounters
from engine.models.bert import (
    Pooling,
    is_encoder,
    load_encoder,
    load_encoder_config,
    load_pooling,
    pool,
)
from engine.outputs import CompletionOutput, RequestOutput
from engine.protocol import ErrorCode, FinishReason
from engine.request_queue import WaitingQueue
from engine.request_state import EngineLoad
from engine.rules import MAX_EMBEDDING_INPUTS

MAX_INPUTS = MAX_EMBEDDING_INPUTS


def encode_embedding(vector: torch.Tensor) -> str:
    """A vector as the wire carries it: base64 of its float32 values, little-endian."""
    return base64.b64encode(vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()


@dataclass(eq=False)
class EmbeddingJob:
    request_id: str
    inputs: list[list[int]]
    tenant: str
    priority: int
    weight: float
    deadline: float | None
    arrival_time: float
    seq_id: int
    next_input: int = 0  # the first input not yet computed
    embeddings: list[str] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


# Token states (tokens, hidden) of inputs laid back to back, `lengths` tokens each.
Encode = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class EmbeddingModel:
    """What the engine runs: the model's forward over a packed batch, and its facts."""

    encode: Encode
    vocab_size: int
    max_model_len: int  # the longest input the model's positions cover
    device: torch.device
    # encode() gives each input's last token's state alone, one row per input (a decoder pooled
    # from its last token: its last layer computes those rows only).
    last_only: bool = False


def load_embedding_model(config: EngineConfig) -> tuple[EmbeddingModel, Pooling]:
    """An encoder directory (BERT family), or a decoder one (any the engine serves but Gemma) run for
    embeddings; the pooling its sentence-transformers files declare, else mean for an encoder and the
    last token for a decoder (where a causal model has read the whole input), normalized."""
    device = torch.device(
        config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if is_encoder(config.model):
        dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            config.dtype
        )
        if dtype is None:
            raise ConfigError(f"an encoder embeds in float32 or bfloat16, not {config.dtype}")
        encoder = load_encoder(config.model, dtype=dtype, device=device)
        limit = load_encoder_config(config.model).max_position_embeddings
        model = EmbeddingModel(encoder, encoder.cfg.vocab_size, limit, device)
        return model, load_pooling(config.model)
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models.loader import load_model

    # The attention backend is never called: encode() attends without a KV cache.
    decoder = load_model(config.model, TorchAttentionBackend(), dtype=config.dtype, device=device)
    cfg = decoder.config
    has_pooling = (Path(config.model) / "modules.json").exists()
    pooling = load_pooling(config.model) if has_pooling else Pooling(mode="last", normalize=True)
    if pooling.mode == "last":
        encode: Encode = functools.partial(decoder.encode, last_only=True)
        model = EmbeddingModel(encode, cfg.vocab_size, cfg.max_position_embeddings, device, last_only=True)
    else:
        model = EmbeddingModel(decoder.encode, cfg.vocab_size, cfg.max_position_embeddings, device)
    return model, pooling


class EmbeddingEngine:
    def __init__(
        self,
        model: EmbeddingModel,
        pooling: Pooling,
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        fair_share: bool = True,
    ) -> None:
        self.model = model
        self.pooling = pooling
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.vocab_size = model.vocab_size
        self.device = model.device
        self.service = ServiceCounters()
        self.waiting: WaitingQueue[EmbeddingJob] = WaitingQueue(self._least_served if fair_share else None)
        self._jobs: dict[str, EmbeddingJob] = {}
        self._aborted: list[str] = []
        self._ids = itertools.count()
        self.num_running = 0  # inputs in the latest step

    @classmethod
    def from_config(cls, config: EngineConfig) -> EmbeddingEngine:
        model, pooling = load_embedding_model(config)
        return cls(
            model,
            pooling,
            max_model_len=min(config.max_model_len or model.max_model_len, model.max_model_len),
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
            fair_share=config.scheduler.policy == "fair",
        )

    def _least_served(self, tenants: OrderedDict[str, deque[EmbeddingJob]]) -> str:
        return min(tenants, key=self.service.service)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        raise InvalidRequestError("this model computes embeddings; it does not generate text")

    def add_embedding_request(
        self,
        request_id: str,
        inputs: list[list[int]],
        *,
        tenant: str = "",
        priority: int = 0,
        weight: float = 1.0,
        deadline: float | None = None,
    ) -> None:
        if request_id in self._jobs:
            raise InvalidRequestError(f"request {request_id} is already running")
        if not isinstance(inputs, list) or not inputs:
            raise InvalidRequestError("an embedding request needs at least one input")
        if len(inputs) > MAX_INPUTS:
            raise RequestTooLargeError(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
        for i, ids in enumerate(inputs):
            if not isinstance(ids, list) or not ids:
                raise InvalidRequestError(f"input {i} is empty")
            if len(ids) > self.max_model_len:
                raise RequestTooLargeError(
                    f"input {i} has {len(ids)} tokens; this model takes at most {self.max_model_len}"
                )
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"input {i} holds a token id outside the vocabulary")
        job = EmbeddingJob(
            request_id=request_id,
            inputs=inputs,
            tenant=tenant,
            priority=priority,
            weight=weight,
            deadline=deadline,
            arrival_time=time.monotonic(),
            seq_id=next(self._ids),
        )
        self._jobs[request_id] = job
        self.service.activate(tenant, weight)
        self.waiting.push(job)

    def abort_request(self, request_id: str) -> None:
        """Takes effect at the next step(), which reports the request finished."""
        if request_id in self._jobs:
            self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._jobs)

    def running_request_ids(self) -> set[str]:
        """Requests of which some input was computed (a drain hands back only the others)."""
        return {rid for rid, job in self._jobs.items() if job.next_input > 0}

    def _end(self, job: EmbeddingJob) -> None:
        self.waiting.remove(job)
        del self._jobs[job.request_id]
        self.service.deactivate(job.tenant)

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = [self._aborted_output(rid) for rid in self._aborted if rid in self._jobs]
        self._aborted.clear()
        outputs += self._expired()
        batch = self._schedule()
        self.num_running = len(batch)
        if not batch:
            return outputs
        lengths = [len(job.inputs[i]) for job, i in batch]
        flat = torch.tensor([t for job, i in batch for t in job.inputs[i]], device=self.device)
        vectors = self._embed(flat, lengths).cpu()
        for (job, _), vector, length in zip(batch, vectors, lengths, strict=True):
            job.embeddings.append(encode_embedding(vector))
            self.service.charge(job.tenant, prompt_tokens=length)
        for job in dict.fromkeys(job for job, _ in batch):
            if len(job.embeddings) == len(job.inputs):
                self._end(job)
                outputs.append(self._finished_output(job))
        return outputs

    def _embed(self, flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        states = self.model.encode(flat, lengths)
        if self.model.last_only:  # already one row per input: its last token's
            return pool(states, [1] * len(lengths), self.pooling)
        return pool(states, lengths, self.pooling)

    def _schedule(self) -> list[tuple[EmbeddingJob, int]]:
        """(job, input index) pairs of the next step, in the waiting order."""
        batch: list[tuple[EmbeddingJob, int]] = []
        tokens = 0
        while len(self.waiting) and len(batch) < self.max_num_seqs:
            job = self.waiting.pop()
            while job.next_input < len(job.inputs) and len(batch) < self.max_num_seqs:
                length = len(job.inputs[job.next_input])
                if batch and tokens + length > self.max_num_batched_tokens:
                    break
                batch.append((job, job.next_input))
                job.next_input += 1
                tokens += length
            if job.next_input < len(job.inputs):
                self.waiting.push(job, first=True)  # the rest of it leads its tenant's queue
                break
        return batch

    def _expired(self) -> list[RequestOutput]:
        now = time.time()
        late = [
            job
            for job in self._jobs.values()
            if job.deadline is not None and job.next_input == 0 and now > job.deadline
        ]
        outputs = []
        for job in late:
            self._end(job)
            outputs.append(
                RequestOutput(
                    request_id=job.request_id,
                    outputs=[],
                    finished=True,
                    num_prompt_tokens=0,
                    error="the request waited past its deadline before it started",
                    error_code=ErrorCode.QUEUE_TIMEOUT,
                )
            )
        return outputs

    def _aborted_output(self, request_id: str) -> RequestOutput:
        job = self._jobs[request_id]
        self._end(job)
        return RequestOutput(
            request_id=request_id,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=[], finish_reason=FinishReason.ABORT)
                for i in range(len(job.inputs))
            ],
            finished=True,
            num_prompt_tokens=sum(len(job.inputs[i]) for i in range(job.next_input)),
        )

    def _finished_output(self, job: EmbeddingJob) -> RequestOutput:
        return RequestOutput(
            request_id=job.request_id,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=[], finish_reason=FinishReason.STOP)
                for i in range(len(job.inputs))
            ],
            finished=True,
            num_prompt_tokens=job.num_prompt_tokens,
            embeddings=job.embeddings,
        )

    def load(self) -> EngineLoad:
        return EngineLoad(
            num_running=self.num_running,
            num_waiting=len(self.waiting),
            kv_cache_usage=0.0,
            prefix_cache_hit_rate=0.0,
            num_free_blocks=0,
            num_total_blocks=0,
            loras_loaded=[],
        )
