"""Rules the web tier and the engine must agree on, written once and imported by both.

The web tier checks requests, adapters and deployments before anything is queued; the engine
checks them again as they arrive. Where the two disagreed, a request or an adapter was accepted
by one and refused by the other. Standard library only: Django code imports this module (with
engine.protocol and engine.chat_template), never the rest of the engine.
"""

from __future__ import annotations

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

# --- Service tiers ----------------------------------------------------------------------------------

# OpenAI's `service_tier` as the engine's priority (a lower number is more important): a waiting
# request of a higher tier preempts running ones of a lower tier, and `flex` runs on spare capacity.
SERVICE_TIER_PRIORITY = {"priority": 0, "default": 1, "flex": 2}
SERVICE_TIERS = ("auto", *SERVICE_TIER_PRIORITY)

# --- LoRA adapters (PEFT format) --------------------------------------------------------------------

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_TARGET_MODULES = LORA_ATTENTION_MODULES + LORA_MLP_MODULES
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


def model_context_length(config: dict[str, Any]) -> int:
    """The longest context served for a checkpoint's config.json: max_position_embeddings, capped by
    a sliding window that is in use (a window at least as long as the context never slides, so
    full attention stays exact). Qwen2 checkpoints carry a window they use only with
    use_sliding_window. Raises ValueError for a malformed or non-positive value."""
    try:
        limit = config.get("max_position_embeddings")
        limit = 2048 if limit is None else int(limit)
        window = config.get("sliding_window")
        qwen2 = config.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (
            config.get("architectures") or []
        )
        if window is not None and (not qwen2 or config.get("use_sliding_window")):
            limit = min(limit, int(window))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed context length ({exc})") from exc
    if limit < 1:
        raise ValueError(f"max_position_embeddings must be positive, got {limit}")
    return limit


# --- Engine options a deployment may set --------------------------------------------------------------

# engine_settings keys of a deployment, as the options of `python -m engine serve`.
ENGINE_SETTING_FLAGS = {
    "device": "--device",
    "seed": "--seed",
    "num_blocks": "--num-blocks",
    "kv_cache_memory": "--kv-cache-memory",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_prefill_tokens_with_decodes": "--max-prefill-tokens-with-decodes",
    "max_held": "--max-held",
    "claim_timeout_ms": "--claim-timeout-ms",
    "heartbeat_interval": "--heartbeat-interval",
    "drain_grace_s": "--drain-grace-s",
    "max_loras": "--max-loras",
    "max_cpu_loras": "--max-cpu-loras",
    "max_lora_rank": "--max-lora-rank",
}
# Boolean settings: the flag is passed when the value is true.
ENGINE_SETTING_SWITCHES = {
    "enforce_eager": "--enforce-eager",
    "no_prefix_caching": "--no-prefix-caching",
    "enable_lora": "--enable-lora",
}
# Switches that are on unless a deployment turns them off: tenants' adapters are served by default.
ENGINE_SETTING_DEFAULTS = {"enable_lora": True}
