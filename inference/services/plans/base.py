"""What every wire format's planner shares: the plan itself (GenerationPlan), the model a request
names (a base deployment, or the caller's adapter on one), the checks of context, n and tier, and
the engine's sampling parameters from the body's fields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from core.errors import InvalidRequestError, model_not_found
from engine.protocol import LoRARef
from engine.rules import SERVICE_TIER_PRIORITY, engine_block_size, max_seqs_per_request
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.structured_output.grammar import grammar_check
from engine.structured_output.spec import StructuredOutputsError
from inference import tokenization
from inference.models import LoraAdapter, ModelDeployment
from inference.selectors import adapter_get_servable, deployment_get_enabled
from tenants.types import AuthContext

# Body fields of the engine's sampling parameters, under the same names: the API checks them by
# building the engine's SamplingParams from them (inference.api.fields.sampling_params_check).
SAMPLING_PARAMS_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "prompt_logprobs",
)
# Those copied as they are (None: the engine default); the others are set by the plan below.
_COPIED_FIELDS = tuple(
    name for name in SAMPLING_PARAMS_FIELDS if name not in {"n", "stop", "logit_bias", "prompt_logprobs"}
)


@dataclass(slots=True)
class GenerationPlan:
    kind: str  # chat | completion | embedding
    request_id: str
    model: str  # the base deployment: its engines serve the request, admission counts against it
    model_path: str
    max_model_len: int
    prompts: list[list[int]]  # one engine request per prompt
    n: int
    max_tokens: int
    sampling_params: dict[str, Any]
    logprobs: int | None = None  # top logprobs per token; None: none returned
    stream: bool = False
    include_usage: bool = False
    adapter: str | None = None  # the tenant's LoRA adapter the request named, if any
    echo: bool = False  # /v1/completions: the prompt is prepended to each choice's text
    discard_output: bool = False  # max_tokens 0: what the engine samples is neither sent nor billed
    prompt_texts: list[str] = field(default_factory=list)  # each prompt's text, for echo
    # Top entries per prompt token when the prompt's logprobs were asked for (echo with logprobs,
    # or vLLM's prompt_logprobs); None: none computed.
    prompt_logprobs: int | None = None
    end_user: str = ""  # safety_identifier (or the older `user`), for the ledger
    prompt_cache_key: str = ""
    lora: LoRARef | None = None
    # Chat with tools: how tool calls are read from the output. auto: the deployment's parser finds
    # them in free text; required / named: the output is generated as the calls' JSON.
    tool_mode: str | None = None  # auto | required | named
    tool_name: str | None = None  # named: the function
    tool_parser: str = ""
    # Chat: how a reasoning model's thinking is read apart from its answer (inference.reasoning);
    # "": the answer is all content.
    reasoning_parser: str = ""
    service_tier: str = "default"  # the tier it runs on: default, flex or priority
    max_queued: int | None = None  # the deployment's bound on requests waiting to start
    # Queued to the replica that holds the prompt's prefix (inference.gateway.routing), whose
    # engines cache blocks of this many tokens; off: the model's shared queue.
    prefix_routing: bool = True
    block_size: int = 16
    # With no ready replica: how long the request waits, queued, for one to start (0: refused at once).
    replica_wait_s: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    # An embedding: its inputs (token ids each) go to the engine as one embed request (`prompts`
    # holds them joined, for admission and the ledger; `n` is their count: one output each).
    inputs: list[list[int]] | None = None

    @property
    def parses_message(self) -> bool:
        """A chat whose text is read into parts (reasoning, content, tool calls) as it streams."""
        return self.tool_mode is not None or bool(self.reasoning_parser)

    @property
    def priority(self) -> int:
        return SERVICE_TIER_PRIORITY[self.service_tier]

    @property
    def served_model(self) -> str:
        """What the request named and the response echoes: the adapter, or the base model."""
        return self.adapter or self.model

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_completion_tokens(self) -> int:
        return self.max_tokens * self.n * len(self.prompts)

    @property
    def engine_request_ids(self) -> list[str]:
        if len(self.prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What a request's `model` names: a base deployment, or the caller's adapter on one."""

    deployment: ModelDeployment
    adapter: LoraAdapter | None = None

    def plan_fields(self) -> dict[str, Any]:
        deployment, adapter = self.deployment, self.adapter
        fields: dict[str, Any] = {
            "model": deployment.name,
            "model_path": deployment.model_path,
            "max_model_len": deployment.max_model_len,
            "max_queued": deployment.max_queued_requests,
            "prefix_routing": deployment.prefix_routing,
            "replica_wait_s": deployment.replica_wait_seconds,
            "block_size": engine_block_size(deployment.engine_settings),
        }
        if adapter is not None:
            fields["adapter"] = adapter.name
            fields["lora"] = LoRARef(name=adapter.name, path=adapter.storage_path, version=adapter.version)
        return fields


def served_model_resolve(*, auth: AuthContext, model: str, task: str | None = "generate") -> ServedModel:
    """A base model the caller may use, or the name of one of the caller's own ready adapters;
    with `task`, one whose deployment does that (a chat with an embedding model, or the reverse, is
    a 400 saying which endpoint serves it).

    Adapter names are looked up in the caller's tenant only: another tenant's adapter is
    model_not_found exactly as a name that does not exist. A base model wins over an adapter of
    the same name (uploads refuse such names, but a tenant may be granted the model later)."""
    if model in auth.allowed_models:
        deployment = deployment_get_enabled(name=model)
        if deployment is None:
            raise model_not_found(model)
        _task_check(deployment, task)
        return ServedModel(deployment)
    adapter = adapter_get_servable(auth=auth, name=model)
    if adapter is None:
        raise model_not_found(model)
    _task_check(adapter.base_model, task)
    return ServedModel(adapter.base_model, adapter)


def _task_check(deployment: ModelDeployment, task: str | None) -> None:
    if task is None or deployment.task == task:
        return
    if deployment.task == ModelDeployment.Task.EMBED:
        message = f"The model `{deployment.name}` computes embeddings; call /v1/embeddings with it."
    else:
        message = f"The model `{deployment.name}` generates text; it does not compute embeddings."
    raise InvalidRequestError(message, param="model", code="model_task_mismatch")


def check_n(*, deployment, n: int) -> None:
    """The deployment's engines run at most this many sequences of one request (a share of their
    slots, so that one request never holds the whole batch): refused here, before anything is queued."""
    limit = max_seqs_per_request(deployment.engine_settings)
    if n > limit:
        raise InvalidRequestError(
            f"n may be at most {limit} for the model `{deployment.name}`, got {n}.", param="n"
        )


def sampling_params_for(
    data: dict[str, Any],
    *,
    n: int,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    model_path: str,
    structured: dict[str, Any] | None = None,
    structured_param: str = "structured_outputs",
) -> dict[str, Any]:
    params: dict[str, Any] = {name: data[name] for name in _COPIED_FIELDS if data.get(name) is not None}
    params.update(n=n, max_tokens=max_tokens, stop=list(data.get("stop") or []))
    bias = data.get("logit_bias")
    if bias:
        # The vocabulary only when there is a bias to check: most requests have none.
        vocab = tokenization.vocab_size(model_path)
        if any(t >= vocab for t in bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab}).", param="logit_bias")
        params["logit_bias"] = {str(t): b for t, b in bias.items()}
    structured = structured or data.get("structured_outputs")
    if structured is not None:
        try:
            grammar_check(structured)
        except StructuredOutputsError as exc:
            raise InvalidRequestError(str(exc), param=structured_param) from exc
        params["structured_outputs"] = structured
    if logprobs is not None:
        params["logprobs"] = logprobs
    if prompt_logprobs is not None:
        params["prompt_logprobs"] = prompt_logprobs
    try:
        # The engine's own check, now that max_tokens is known (it may follow from the prompt).
        SamplingParams.from_dict(params)
    except SamplingParamsError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc
    return params


def service_tier_resolve(*, auth: AuthContext, asked: str | None) -> str:
    """The tier a request runs on: the one it asked for if the operator allows it the tenant,
    `auto` (or none) the tenant's default (default, else flex, else priority)."""
    allowed = auth.tenant_limits.service_tiers
    if asked in (None, "auto"):
        tier = next((t for t in ("default", "flex", "priority") if t in allowed), None)
        if tier is None:
            raise InvalidRequestError(
                "No service tier is enabled for this organization.",
                param="service_tier",
                code="service_tier_unavailable",
            )
        return tier
    if asked not in allowed:
        enabled = ", ".join(t for t in SERVICE_TIER_PRIORITY if t in allowed) or "none"
        raise InvalidRequestError(
            f"The service tier `{asked}` is not enabled for this organization (enabled: {enabled}).",
            param="service_tier",
            code="service_tier_unavailable",
        )
    return asked


def plan_common(
    *, auth: AuthContext, data: dict[str, Any], target: ServedModel, request_id: str
) -> dict[str, Any]:
    """The plan's fields every wire format sets alike: the model (and adapter), n (checked against
    the deployment), streaming, the tier, and the caller's ids for the ledger."""
    n = data.get("n") or 1
    check_n(deployment=target.deployment, n=n)
    stream = bool(data.get("stream"))
    return {
        "request_id": request_id,
        **target.plan_fields(),
        "n": n,
        "stream": stream,
        "include_usage": bool(stream and (data.get("stream_options") or {}).get("include_usage")),
        "service_tier": service_tier_resolve(auth=auth, asked=data.get("service_tier")),
        "end_user": data.get("safety_identifier") or data.get("user") or "",
        "prompt_cache_key": data.get("prompt_cache_key") or "",
    }
