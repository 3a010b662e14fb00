"""Rules the web tier and the engine must agree on, written once and imported by both.

The web tier checks requests, adapters and deployments before anything is queued; the engine
checks them again as they arrive. Where the two disagreed, a request or an adapter was accepted
by one and refused by the other. Standard library only: Django code imports this module (with
engine.protocol and engine.chat_template), never the rest of the engine.
"""

from __future__ import annotations

import math
import re
from typing import Any

# --- OpenAI request limits --------------------------------------------------------------------------

MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
# Characters per stop string: stop matching costs (new text + longest stop) per step, so one request
# with a huge stop string would slow the step loop every tenant on the replica shares.
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20  # OpenAI's ceiling on `top_logprobs`
MAX_N = 128  # OpenAI's limit on `n`
# OpenAI's range of a `logit_bias` value, and the token ids one request may bias.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# /v1/completions: prompts in one request, and sequences one request may start (prompts x n): one
# request must not fill a replica's batch on its own.
MAX_COMPLETION_PROMPTS = 64
MAX_SEQUENCES_PER_REQUEST = 128

# --- Sequence slots ---------------------------------------------------------------------------------

# A replica's decode slots (engine setting max_num_seqs) when a deployment names none.
DEFAULT_MAX_NUM_SEQS = 128


def default_max_seqs_per_request(max_num_seqs: int) -> int:
    """The sequences (`n`) one request may run on a replica with `max_num_seqs` slots when the
    deployment sets no max_seqs_per_request: a quarter of the slots (at least 2 where that still
    leaves one), so that one request never holds the whole batch while other tenants queue."""
    return max(1, max_num_seqs // 4, min(2, max_num_seqs - 1))


# Tokens per KV-cache block: the unit of the prefix cache, and of the prefix hashes the web tier
# routes by (a deployment's engine_settings block_size).
DEFAULT_BLOCK_SIZE = 16


def engine_block_size(engine_settings: dict[str, Any] | None) -> int:
    return int((engine_settings or {}).get("block_size") or DEFAULT_BLOCK_SIZE)


def max_seqs_per_request(engine_settings: dict[str, Any] | None) -> int:
    """The `n` a deployment's engines accept, from its engine_settings (the same rule as
    engine.config.SchedulerConfig, so that the web tier refuses what the engine would)."""
    settings = engine_settings or {}
    explicit = settings.get("max_seqs_per_request")
    if explicit:
        return int(explicit)
    return default_max_seqs_per_request(int(settings.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS))


# --- Service tiers ----------------------------------------------------------------------------------

# OpenAI's `service_tier` as the engine's priority (a lower number is more important): a waiting
# request of a higher tier preempts running ones of a lower tier, and `flex` runs on spare capacity.
SERVICE_TIER_PRIORITY = {"priority": 0, "default": 1, "flex": 2}
SERVICE_TIERS = ("auto", *SERVICE_TIER_PRIORITY)
# The tier that runs on spare capacity (`flex`, the batch lines).
SPARE_CAPACITY_PRIORITY = SERVICE_TIER_PRIORITY["flex"]

# --- LoRA adapters (PEFT format) --------------------------------------------------------------------

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# qkv_proj and gate_up_proj: Phi-3's fused projections, which its adapters target as one module.
LORA_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
LORA_MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
LORA_TARGET_MODULES = LORA_ATTENTION_MODULES + LORA_MLP_MODULES
# A fused target's parts, in the order of its output rows.
LORA_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def lora_module_dims(
    *, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every module an adapter may target on a decoder layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "qkv_proj": (hidden, q + 2 * kv),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
        "gate_up_proj": (hidden, 2 * intermediate),
    }


# --- Mixture of experts -----------------------------------------------------------------------------

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


def moe_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """The decoder layers of a config.json whose MLP is a mixture of experts (none for a dense
    model): every layer of Mixtral; Qwen3-MoE's every decoder_sparse_step-th layer not listed in
    mlp_only_layers. An adapter cannot target those layers' MLP. ValueError for malformed fields."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not any(a in MOE_ARCHITECTURES for a in archs):
        return ()
    layers = int(config["num_hidden_layers"])
    if "MixtralForCausalLM" in archs:
        return tuple(range(layers))
    step = config.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    dense = config.get("mlp_only_layers") or []
    if step < 1 or not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError("decoder_sparse_step must be positive and mlp_only_layers a list of layer numbers")
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


# adapter_config.json options that change what a LoRA computes in ways the engine does not implement.
_LORA_UNSUPPORTED_FLAGS = (
    "use_dora",
    "fan_in_fan_out",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layers_pattern",
    "target_parameters",
)


def lora_unsupported_options(config: dict[str, Any]) -> list[str]:
    """The options of an adapter_config.json that the engine cannot serve, in a stable order."""
    named = [key for key in _LORA_UNSUPPORTED_FLAGS if config.get(key)]
    if config.get("bias", "none") != "none":
        named.append("bias")
    return named


# --- Context length ---------------------------------------------------------------------------------


# The checkpoint architectures (config.json "architectures") the engine implements.
SERVED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# Gemma 2 and 3 slide a window on some layers only (config.json's layer_types): the context is not
# capped by it.
PER_LAYER_WINDOW_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def served_architecture(config: dict[str, Any]) -> str:
    """The first of a config.json's architectures that the engine serves; ValueError naming the
    served ones when there is none."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures must be a list of names, got {archs!r}")
    served = next((a for a in archs if a in SERVED_ARCHITECTURES), None)
    if served is None:
        raise ValueError(
            f"architecture {archs or config.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SERVED_ARCHITECTURES)})"
        )
    return served


# Encoders (BERT family): an embedding deployment; every served decoder generates.
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
TASKS = ("generate", "embed")
# Inputs one embedding request may hold (OpenAI's bound on `input`).
MAX_EMBEDDING_INPUTS = 2048


def model_tasks(config: dict[str, Any]) -> tuple[str, ...]:
    """The tasks a checkpoint's config.json allows, its default first: a BERT-family encoder only
    embeds; a decoder the engine serves generates, or embeds when the operator says it is an
    embedding model built on a decoder (pooled from its last token unless its sentence-transformers
    files say otherwise; not Gemma, whose windowed and soft-capped attention the embedding path
    does not run). ValueError for anything else."""
    archs = config.get("architectures") or []
    if config.get("model_type") == "bert" or (
        isinstance(archs, list) and any(a in ENCODER_ARCHITECTURES for a in archs)
    ):
        return ("embed",)
    if served_architecture(config) in PER_LAYER_WINDOW_ARCHITECTURES:
        return ("generate",)
    return ("generate", "embed")


def model_task(config: dict[str, Any], requested: str | None = None) -> str:
    """The task of a deployment of this checkpoint: `requested` where the checkpoint allows it, else
    ValueError; None: the checkpoint's default (embed for an encoder, generate for a decoder)."""
    tasks = model_tasks(config)
    if requested is None:
        return tasks[0]
    if requested not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {requested!r}")
    if requested not in tasks:
        raise ValueError(f"an encoder (BERT family) cannot {requested}; its task is {tasks[0]}")
    return requested


def sliding_window_in_use(config: dict[str, Any]) -> Any:
    """A config.json's sliding_window where the model uses it, else None: Qwen2 and Qwen3
    and Qwen3-MoE checkpoints carry a window they use only with use_sliding_window."""
    window = config.get("sliding_window")
    archs = config.get("architectures") or []
    if any(a in archs for a in PER_LAYER_WINDOW_ARCHITECTURES):
        return None
    opt_in = config.get("model_type") in ("qwen2", "qwen3", "qwen3_moe") or any(
        a in archs for a in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    )
    return window if window is not None and (not opt_in or config.get("use_sliding_window")) else None


def model_context_length(config: dict[str, Any]) -> int:
    """The longest context served for a checkpoint's config.json: max_position_embeddings, capped by
    a sliding window that is in use (a window at least as long as the context never slides, so
    full attention stays exact; `sliding_window_in_use`). Raises ValueError for a malformed or
    non-positive value."""
    try:
        limit = config.get("max_position_embeddings")
        limit = 2048 if limit is None else int(limit)
        window = sliding_window_in_use(config)
        if window is not None:
            limit = min(limit, int(window))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed context length ({exc})") from exc
    if limit < 1:
        raise ValueError(f"max_position_embeddings must be positive, got {limit}")
    return limit


# --- Engine options a deployment may set --------------------------------------------------------------

# engine_settings keys of a deployment, each the option --key-with-dashes of `python -m engine
# serve`, with the kind of value it takes (a test holds this to that command's parser): "int",
# "float", "size" (bytes, or text such as 512MiB), "text", or "switch" (the flag is passed when true).
ENGINE_SETTINGS = {
    "device": "text",
    "seed": "int",
    "num_blocks": "int",
    "kv_cache_memory": "size",
    "gpu_memory_utilization": "float",
    "block_size": "int",
    "max_num_seqs": "int",
    "max_seqs_per_request": "int",
    "fair_preempt_tokens_per_step": "int",
    "shared_step_slowdown": "float",
    "decode_fixed_rows": "float",
    "prompt_token_rows": "float",
    "decode_key_rows": "float",
    "prompt_key_rows": "float",
    "prompt_logprob_rows": "float",
    "max_num_batched_tokens": "int",
    "max_prefill_tokens_with_decodes": "int",
    "lower_tier_prefill_tokens": "int",
    "max_held": "int",
    "claim_timeout_ms": "int",
    "steal_after_ms": "int",
    "heartbeat_interval": "float",
    "drain_grace_s": "float",
    "max_failovers": "int",
    "quiet_publish_s": "float",
    "max_loras": "int",
    "max_cpu_loras": "int",
    "max_lora_rank": "int",
    "grammar_compile_timeout_s": "float",
    "grammar_max_compiles": "int",
    "grammar_max_compiles_per_tenant": "int",
    "grammar_compile_nice": "int",
    "grammar_max_mask_ms": "float",
    "grammar_max_request_mask_ms": "float",
    "grammar_cache_bytes": "size",
    "num_speculative_tokens": "int",
    "prompt_lookup_min": "int",
    "prompt_lookup_max": "int",
    "speculative_draft_model": "text",
    "speculative_draft_blocks": "int",
    "enforce_eager": "switch",
    "no_prefix_caching": "switch",
    "no_step_interrupts": "switch",
    "enable_lora": "switch",
}
ENGINE_SETTING_FLAGS = {
    key: "--" + key.replace("_", "-") for key, kind in ENGINE_SETTINGS.items() if kind != "switch"
}
ENGINE_SETTING_SWITCHES = {
    key: "--" + key.replace("_", "-") for key, kind in ENGINE_SETTINGS.items() if kind == "switch"
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]i?)?b?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2GiB', '1.5GB'; ValueError for anything else."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def engine_settings_errors(engine_settings: Any) -> list[str]:
    """What is wrong with a deployment's engine_settings (an empty list when nothing is): unknown
    keys, and values of the wrong kind. Checked where a deployment is saved (the model, so the
    admin and the services too) and by the commands that start engines."""
    if not isinstance(engine_settings, dict):
        return ["engine_settings must be an object of key: value"]
    errors = []
    for key, value in engine_settings.items():
        kind = ENGINE_SETTINGS.get(key)
        if kind is None:
            errors.append(f"unknown engine setting {key!r}; known: {', '.join(sorted(ENGINE_SETTINGS))}")
        elif value is None:
            continue
        elif kind == "switch":
            if not isinstance(value, bool):
                errors.append(f"{key} must be true or false, got {value!r}")
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                errors.append(f"{key} must be an integer, got {value!r}")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                errors.append(f"{key} must be a number, got {value!r}")
        elif kind == "size":
            if isinstance(value, bool) or not isinstance(value, int | str):
                errors.append(f"{key} must be a number of bytes or a size such as 512MiB, got {value!r}")
            elif isinstance(value, str):
                try:
                    parse_size(value)
                except ValueError as exc:
                    errors.append(f"{key}: {exc}")
        elif not isinstance(value, str):
            errors.append(f"{key} must be text, got {value!r}")
    return errors


# Switches that are on unless a deployment turns them off: tenants' adapters are served by default.
ENGINE_SETTING_DEFAULTS = {"enable_lora": True}
