"""Wire messages between the web tier and engine workers, over Redis. Versioned JSON (encoded and
decoded by orjson: these run per request per step on both sides), never pickle.

The Django side imports this module, engine.rules and engine.chat_template, never the rest of the engine.

Redis layout (every key starts with the deployment's prefix, e.g. "pagoda:"):
- `{prefix}requests:{model}`     stream of GenerateRequest, consumer group `engines`; several replicas
                                 of one model share it; a request is acked when it has finished.
- `{prefix}requests:{model}:replica:{replica_id}`  a replica's own request stream (same group):
                                 requests routed to it by prefix (inference.gateway.routing); it
                                 reads it before the shared one, and an idle replica steals its
                                 entries that waited past the steal delay.
- `{prefix}routes:{model}`       set of the replica ids that have a request stream of their own.
- `{prefix}prefix:{model}:{hash}`  the replica a prompt prefix was last routed to, with a TTL.
- `{prefix}out:{request_id}`     stream of events for one request (delta, finished, error), with a TTL;
                                 replayable, so a late or reconnecting reader loses nothing. A delta
                                 per step, or for a request queued with `stream` false, its first
                                 tokens, then a delta at its end and every `quiet_publish_s` (1 s).
                                 Entry ids are `<ms>-<n>`: the replica that runs the request numbers its
                                 events 0, 1, 2, ... under one millisecond stamp, so a write resent
                                 after a lost connection is refused as a duplicate, and a reader sees
                                 a gap when entries were lost.
- `{prefix}usage:{request_id}`   the request's last event (finished or error, with its usage), kept an
                                 hour: what a settler bills when the web process that took it is gone.
- `{prefix}cancel:{model}`       stream of request ids to abort; every replica reads all of it.
- `{prefix}engines:{model}`      sorted set of replica ids scored by their last heartbeat (unix time).
- `{prefix}engine:{model}:{replica_id}`  JSON stats of one replica, with a TTL.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from engine.rules import TASKS

PROTOCOL_VERSION = 1
CONSUMER_GROUP = "engines"


class FinishReason(StrEnum):
    """Why a sequence ended (FinishedOutput.finish_reason). The web tier maps every member to what
    its client sees (inference.services.generation); a test fails on a member without a mapping."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"  # cancelled
    ERROR = "error"  # failed (the request's error event says why)


class ErrorCode(StrEnum):
    """The code of an engine's error event (Event.code). The web tier maps every member to an HTTP
    status and an OpenAI error; a test fails on a member without a mapping."""

    ENGINE_ERROR = "engine_error"  # the engine failed (a step, a grammar compile process)
    INVALID_REQUEST = "invalid_request"  # the request is malformed (the engine's own checks)
    REQUEST_TOO_LARGE = "request_too_large"  # it can never fit this replica's KV cache
    QUEUE_TIMEOUT = "queue_timeout"  # dropped unstarted: its deadline passed; nothing billed
    LORA_UNAVAILABLE = "lora_unavailable"  # this replica serves no adapters
    LORA_LOAD_FAILED = "lora_load_failed"  # the adapter named could not be loaded
    GRAMMAR_TOO_COSTLY = "grammar_too_costly"  # its token masks cost more than the replica allows
    GRAMMAR_COMPILE_TIMEOUT = "grammar_compile_timeout"  # its grammar compiled past the timeout
    ENGINE_FAILED = "engine_failed"  # the replica running it died after streaming part of it
    ENGINE_SHUTDOWN = "engine_shutdown"  # the replica stopped (past its drain grace) while it ran


class ProtocolError(ValueError):
    """A message on the wire is malformed or of an unknown version."""


def requests_stream(prefix: str, model: str) -> str:
    return f"{prefix}requests:{model}"


def replica_requests_stream(prefix: str, model: str, replica_id: str) -> str:
    return f"{prefix}requests:{model}:replica:{replica_id}"


def routes_key(prefix: str, model: str) -> str:
    """A set of the replica ids of a model that have a request stream of their own."""
    return f"{prefix}routes:{model}"


def request_streams(prefix: str, model: str, routed_replicas: Iterable[bytes | str]) -> list[str]:
    """Every request stream of a model: its shared stream, then the own stream of each routed
    replica (the members of `routes_key`), in the order of their ids."""
    replicas = sorted(r.decode() if isinstance(r, bytes) else r for r in routed_replicas)
    return [requests_stream(prefix, model), *(replica_requests_stream(prefix, model, r) for r in replicas)]


def prefix_route_key(prefix: str, model: str, block_hash: str) -> str:
    return f"{prefix}prefix:{model}:{block_hash}"


def output_stream(prefix: str, request_id: str) -> str:
    return f"{prefix}out:{request_id}"


def usage_key(prefix: str, request_id: str) -> str:
    return f"{prefix}usage:{request_id}"


def entry_gap(previous: bytes | str | None, current: bytes | str) -> bool:
    """Whether entries were lost between two consecutive entries of an output stream as one reader
    saw them (`previous` None: `current` is the first). Within one replica's run of a request the
    numbers go 0, 1, 2, ... under one stamp; a new stamp (a replica that took the request over)
    starts at 0 again."""
    ms, _, seq = (current.decode() if isinstance(current, bytes) else current).partition("-")
    if previous is None:
        return int(seq or 0) != 0
    prev_ms, _, prev_seq = (previous.decode() if isinstance(previous, bytes) else previous).partition("-")
    if prev_ms == ms:
        return int(seq or 0) != int(prev_seq or 0) + 1
    return int(seq or 0) != 0


def cancel_stream(prefix: str, model: str) -> str:
    return f"{prefix}cancel:{model}"


def replicas_key(prefix: str, model: str) -> str:
    return f"{prefix}engines:{model}"


def replica_stats_key(prefix: str, model: str, replica_id: str) -> str:
    return f"{prefix}engine:{model}:{replica_id}"


def cancel_message(request_id: str) -> dict[str, str]:
    """An entry of the cancel stream: the web tier adds one when the client of a request goes away."""
    return {"request_id": request_id}


def cancel_request_id(fields: dict) -> str | None:
    """The request id of a cancel-stream entry, or None when the entry carries none."""
    value = fields.get(b"request_id", fields.get("request_id"))
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value or None


@dataclass(slots=True)
class LoRARef:
    name: str  # unique within the tenant; the engine keys its slots by (tenant, name, version)
    path: str  # directory with adapter_config.json and adapter_model.safetensors
    version: str = ""  # changes when the adapter is re-uploaded


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]  # engine.sampling_params.SamplingParams.to_dict()
    tenant: str = ""
    priority: int = 0
    cache_salt: str | None = None  # assigned by the server (the tenant), never from the request body
    lora: LoRARef | None = None
    created_at: float = 0.0  # unix time the web tier queued it
    weight: float = 1.0  # the tenant's fair-share weight
    deadline: float | None = None  # unix time by which it must have started, else queue_timeout
    # generate, or embed: `inputs` (token ids each) are embedded, prompt_token_ids and
    # sampling_params unused; the finished event carries one embedding per input.
    task: str = "generate"
    inputs: list[list[int]] | None = None
    # False: its reader answers once, with the whole output (a JSON body, a batch line), so the
    # replica publishes its first tokens at once and the rest together (engine.worker.outputs).
    stream: bool = True
    v: int = PROTOCOL_VERSION

    def encode(self) -> dict[bytes | str, bytes | str]:
        return {"data": orjson.dumps(asdict(self), option=orjson.OPT_NON_STR_KEYS)}

    @classmethod
    def decode(cls, fields: dict) -> GenerateRequest:
        raw = _data_field(fields)
        if raw.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {raw.get('v')!r}")
        lora = raw.pop("lora", None)
        try:
            request = cls(**raw, lora=LoRARef(**lora) if lora else None)
        except TypeError as exc:
            raise ProtocolError(f"malformed generate request: {exc}") from exc
        if not request.request_id or not isinstance(request.prompt_token_ids, list):
            raise ProtocolError("generate request needs a request_id and prompt_token_ids")
        if request.task not in TASKS:
            raise ProtocolError(f"unknown task {request.task!r}")
        if request.task == "embed" and not isinstance(request.inputs, list):
            raise ProtocolError("an embed request needs its inputs")
        return request

    @property
    def num_prompt_tokens(self) -> int:
        if self.task == "embed":
            return sum(len(ids) for ids in self.inputs or [])
        return len(self.prompt_token_ids)

    @property
    def num_outputs(self) -> int:
        """Its outputs: an embed request's inputs, a generation's `n`."""
        if self.task == "embed":
            return len(self.inputs or [])
        return int(self.sampling_params.get("n", 1)) if isinstance(self.sampling_params, dict) else 1


@dataclass(slots=True)
class DeltaOutput:
    index: int
    text: str
    token_ids: list[int]
    # One entry per new token: {"token_id", "logprob", "top": [[token_id, logprob], ...]}.
    logprobs: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class FinishedOutput:
    index: int
    finish_reason: str  # a FinishReason
    stop_reason: int | str | None = None
    embedding: str | None = None  # an embed request's vector: base64 of little-endian float32


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True)
class Event:
    """One entry of a request's output stream."""

    # delta | finished | error | failover (a replica took the request over from a lost one: what
    # follows continues the stream; `replica` names the new holder)
    type: str
    outputs: list[dict[str, Any]] = field(default_factory=list)  # DeltaOutput / FinishedOutput dicts
    usage: dict[str, int] | None = None  # on finished (and on error when tokens were produced)
    message: str | None = None  # on error
    code: str | None = None  # on error: an ErrorCode
    replica: str | None = None
    # On a delta, once, when the request asked for prompt logprobs: one entry per prompt token,
    # None for the first, else {"token_id", "logprob", "rank", "top": [[token_id, logprob], ...]}.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # On finished: where the request's time to its first token went, as unix times: `queued` (the
    # web tier queued it; 0 for a request that had streamed on a replica lost since), `taken` (this
    # replica took it from its stream), `first_token` (the step that produced its first token here
    # ended; absent when none was produced here).
    timing: dict[str, float] | None = None
    v: int = PROTOCOL_VERSION

    @classmethod
    def delta(cls, outputs: list[DeltaOutput]) -> Event:
        # Built field by field: asdict deep-copies every list, and this runs per request per step.
        return cls(
            type="delta",
            outputs=[
                {"index": o.index, "text": o.text, "token_ids": o.token_ids, "logprobs": o.logprobs}
                for o in outputs
            ],
        )

    @classmethod
    def finished(
        cls, outputs: list[FinishedOutput], usage: Usage, timing: dict[str, float] | None = None
    ) -> Event:
        bodies = []
        for o in outputs:
            body: dict[str, Any] = {
                "index": o.index,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            if o.embedding is not None:  # an embed request's; a generation's outputs stay as they were
                body["embedding"] = o.embedding
            bodies.append(body)
        return cls(type="finished", outputs=bodies, usage=asdict(usage), timing=timing)

    @classmethod
    def error(cls, message: str, code: str, usage: Usage | None = None) -> Event:
        return cls(type="error", message=message, code=code, usage=asdict(usage) if usage else None)

    @classmethod
    def failover(cls, replica: str) -> Event:
        return cls(type="failover", replica=replica)

    def encode(self) -> dict[str, bytes]:
        # The fields as they are (no deep copy: encoding only reads them), by the fast encoder.
        return {"data": orjson.dumps({name: getattr(self, name) for name in _EVENT_FIELDS})}

    @classmethod
    def decode(cls, fields: dict) -> Event:
        raw = _data_field(fields)
        if raw.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {raw.get('v')!r}")
        try:
            event = cls(**raw)
        except TypeError as exc:
            raise ProtocolError(f"malformed event: {exc}") from exc
        if event.type not in EVENT_TYPES:
            raise ProtocolError(f"unknown event type {event.type!r}")
        return event


_EVENT_FIELDS = tuple(Event.__dataclass_fields__)
EVENT_TYPES = frozenset({"delta", "finished", "error", "failover"})


def _data_field(fields: dict) -> dict[str, Any]:
    data = fields.get(b"data", fields.get("data"))
    if data is None:
        raise ProtocolError("message has no data field")
    try:
        raw = orjson.loads(data)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"message is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError("message is not a JSON object")
    return raw


@dataclass(slots=True)
class ReplicaStats:
    replica_id: str
    model: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    loras_loaded: list[str] = field(default_factory=list)
    # Requests this replica took over from lost replicas and continued, and the tokens they had
    # streamed there (computed again here, less what the prefix cache held).
    num_resumed_requests: int = 0
    num_resumed_tokens: int = 0
    # Speculative decoding since start: draft tokens verified, and those accepted.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Requests taken since start from this replica's own stream (routed to it by prefix), and
    # stolen from other replicas' streams where they waited past the steal delay.
    num_routed_requests: int = 0
    num_stolen_requests: int = 0
    # Spare-capacity (flex) steps given up since start for a more important arrival.
    num_interrupted_steps: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    # Shutting down: it finishes what runs but takes nothing new (not ready; still live).
    draining: bool = False
    v: int = PROTOCOL_VERSION

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, data: bytes | str) -> ReplicaStats:
        try:
            return cls(**json.loads(data))
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed replica stats: {exc}") from exc
