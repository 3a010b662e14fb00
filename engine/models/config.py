"""What the engine needs to know about a checkpoint, read from its config.json and generation_config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.rules import (
    MOE_ARCHITECTURES,
    PER_LAYER_WINDOW_ARCHITECTURES,
    SERVED_ARCHITECTURES,
    model_context_length,
    moe_layers,
    served_architecture,
    sliding_window_in_use,
)

# Architectures served by engine.models.llama; all share the Llama decoder layout (Mixtral and
# Qwen3-MoE with a sparse mixture of experts in place of the MLP: engine.models.moe).
SUPPORTED_ARCHITECTURES = SERVED_ARCHITECTURES
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class ModelLoadError(EngineError):
    """The model directory is missing, malformed, or does not match its own config."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is well formed but uses an architecture or feature the engine does not implement."""


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    torch_dtype: str
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before the rotary embedding
    # The leading dims of each head that the rotary embedding turns (Phi-4-mini: 3/4 of them); the
    # rest pass through. None: the whole head.
    rotary_dim: int | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): the layers whose MLP is a sparse block of
    # num_experts experts, each token routed to num_experts_per_tok of them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to one
    moe_layers: tuple[int, ...] = ()
    # Gemma 2/3: the embedding scaled by sqrt(hidden), RMSNorm weights as offsets from one, a norm
    # after attention and after the MLP too, GELU (tanh) gating, 1/sqrt(query_pre_attn_scalar) as
    # the attention scale, soft-capped attention scores and logits (Gemma 2), and a sliding window
    # on some layers (layer_windows: each layer's window, None for full attention), whose rotary
    # base is local_rope_theta (Gemma 3) where given.
    gemma: bool = False
    hidden_act: str = "silu"
    attention_scale: float | None = None  # None: 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def kv_window(self) -> int | None:
        """The window of the windowed layers, when some layers have one and all of those share it:
        their KV blocks come from a pool of their own that frees what falls out of the window
        (engine.block_manager). None: every layer keeps every block."""
        windows = {w for w in self.layer_windows if w is not None}
        return windows.pop() if len(windows) == 1 else None

    @property
    def max_model_len(self) -> int:
        # The rule the web tier applies too (engine.rules.model_context_length).
        return model_context_length(
            {"max_position_embeddings": self.max_position_embeddings, "sliding_window": self.sliding_window}
        )

    @property
    def rotary_dims(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path.parent}: missing {path.name}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


# Keys each scaled rope type reads; a checkpoint without them is refused here rather than failing
# half-way through building the model.
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def _rope(raw: dict[str, Any], arch: str, rotary_dim: int) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters (theta inside); older checkpoints (every Llama 3.1 on
    # the hub) write rope_theta beside rope_scaling.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # the names early Phi-3 configs gave LongRoPE
    if rope_type == "longrope":
        return theta, _longrope(raw, params, rotary_dim)
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {_SUPPORTED_ROPE_TYPES})"
        )
    if rope_type == "default":
        return theta, None
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in params]
    if missing:
        raise ModelLoadError(
            f"rope type {rope_type!r} needs {', '.join(missing)} in rope_parameters / rope_scaling"
        )
    scaling = {**params, "rope_type": rope_type}
    for k in _ROPE_KEYS[rope_type]:
        value = float(scaling[k])
        if not value > 0:
            raise ModelLoadError(f"rope parameter {k} must be positive, got {scaling[k]!r}")
    if rope_type == "llama3" and not float(scaling["high_freq_factor"]) > float(scaling["low_freq_factor"]):
        raise ModelLoadError("rope parameter high_freq_factor must be greater than low_freq_factor")
    return theta, scaling


def _longrope(raw: dict[str, Any], params: dict[str, Any], rotary_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE: per-frequency factors for short and long contexts, and the attention
    factor that scales cos and sin (from the context's growth over the pre-training one unless
    given)."""
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if original is None:
        raise ModelLoadError("rope type 'longrope' needs original_max_position_embeddings")
    original = int(original)
    if original < 1:
        raise ModelLoadError(f"original_max_position_embeddings must be positive, got {original}")
    scaling: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": original}
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
            raise ModelLoadError(f"rope parameter {key} must be a list of {rotary_dim // 2} numbers")
        values = [float(f) for f in factors]
        if not all(v > 0 for v in values):
            raise ModelLoadError(f"rope parameter {key} must hold positive numbers")
        scaling[key] = values
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(raw.get("max_position_embeddings", 2048)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling["attention_factor"] = float(attention)
    return scaling


def _rotary_dim(raw: dict[str, Any], head_dim: int) -> int | None:
    params = raw.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if not 0 < factor <= 1:
        raise ModelLoadError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    dim = int(head_dim * factor)
    if dim == head_dim:
        return None
    if dim < 2 or dim % 2:
        raise UnsupportedModelError(f"a rotary embedding over {dim} of {head_dim} head dims is not supported")
    return dim


def _moe(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig for Mixtral and Qwen3-MoE; {} for a dense model.
    Qwen3-MoE's dense layers keep an MLP of intermediate_size."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = _positive(raw, "num_local_experts", raw.get("num_experts"))
    top_k = _positive(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ModelLoadError(f"num_experts_per_tok ({top_k}) exceeds the {experts} experts")
    mixtral = arch == "MixtralForCausalLM"
    try:
        layers = moe_layers(raw)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": _positive(raw, "intermediate_size" if mixtral else "moe_intermediate_size"),
        "norm_topk_prob": True if mixtral else bool(raw.get("norm_topk_prob", False)),
        "moe_layers": layers,
    }


def _gemma(raw: dict[str, Any], arch: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 2/3's ModelConfig fields, and the config to read the (global) rotary embedding from.

    Layers without a layer_types entry follow the families' patterns: Gemma 2 slides on every
    other layer from the first, Gemma 3 on five of every six (sliding_window_pattern). Gemma 3's
    rope_parameters may hold one entry per layer type; the sliding layers' is a plain rotation."""
    layers = _positive(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(f"layer_types must list one type per layer, got {types!r}")
    unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if unknown:
        raise UnsupportedModelError(f"layer types {unknown} are not supported")
    window = raw.get("sliding_window")
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an embedding Gemma) is not supported")
    softcaps = {}
    for key, name in (
        ("attn_logit_softcapping", "attn_logit_softcap"),
        ("final_logit_softcapping", "final_logit_softcap"),
    ):
        default = (50.0 if key.startswith("attn") else 30.0) if arch == "Gemma2ForCausalLM" else None
        value = raw.get(key, default)
        softcaps[name] = None if value is None else float(value)
        if value is not None and not float(value) > 0:
            raise ModelLoadError(f"{key} must be positive, got {value!r}")
    scalar = float(raw.get("query_pre_attn_scalar", 256))
    if not scalar > 0:
        raise ModelLoadError(f"query_pre_attn_scalar must be positive, got {scalar}")
    rope_raw, local_theta = raw, None
    params = raw.get("rope_parameters")
    if arch == "Gemma3ForCausalLM":
        if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(
                    "a scaled rotary embedding on the sliding layers is not supported"
                )
            local_theta = float(local.get("rope_theta", 10000.0))
            rope_raw = {
                **raw,
                "rope_parameters": {"rope_theta": 1000000.0, **(params.get("full_attention") or {})},
            }
        else:
            local_theta = float(raw.get("rope_local_base_freq", 10000.0))
            rope_raw = {**raw, "rope_theta": raw.get("rope_theta", 1000000.0)}
    fields = {
        "gemma": True,
        "hidden_act": "gelu_pytorch_tanh",
        "attention_scale": scalar**-0.5,
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "local_rope_theta": local_theta,
        **softcaps,
    }
    return fields, rope_raw


def _positive(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    # null counts as absent: exporters write "head_dim": null for the derived value.
    value = raw.get(key)
    if value is None:
        value = default
    if value is None:
        raise KeyError(key)
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
        raise ModelLoadError(f"config field {key} must be a positive integer, got {value!r}")
    return int(value)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse and check config.json (+ generation_config.json); raises ModelLoadError / UnsupportedModelError."""
    root = Path(model_dir)
    if not root.is_dir():
        fault = "is not a directory" if root.exists() else "does not exist"
        raise ModelLoadError(f"model directory {str(root)!r} {fault}")
    raw = _read_json(root / "config.json")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"{root}/config.json: architectures must be a list of names, got {archs!r}")
    try:
        arch = served_architecture(raw)
    except ValueError as exc:
        raise UnsupportedModelError(f"{root}: {exc}") from None
    gemma = arch in PER_LAYER_WINDOW_ARCHITECTURES
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise UnsupportedModelError(
            f"{root}: hidden activation {act!r} is not supported for {arch} "
            f"(only {'gelu_pytorch_tanh' if gemma else 'silu'})"
        )
    try:
        hidden, heads = _positive(raw, "hidden_size"), _positive(raw, "num_attention_heads")
        head_dim = _positive(raw, "head_dim", hidden // heads)
        rotary_dim = _rotary_dim(raw, head_dim)
        gemma_fields, rope_raw = _gemma(raw, arch) if gemma else ({}, raw)
        theta, scaling = _rope(rope_raw, arch, rotary_dim or head_dim)
        window = sliding_window_in_use(raw)
        num_layers = _positive(raw, "num_hidden_layers")
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=_positive(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=_positive(raw, "num_key_value_heads", heads),
            head_dim=head_dim,
            intermediate_size=_positive(raw, "intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_positive(raw, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            rotary_dim=rotary_dim,
            **_moe(raw, arch),
            **gemma_fields,
            sliding_window=int(window) if window is not None else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_list(raw.get("eos_token_id")),
        )
    except ModelLoadError as exc:  # raised by the field checks, which do not know the path
        raise type(exc)(f"{root}/config.json: {exc}") from None
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ModelLoadError(f"{root}/config.json: missing or invalid field ({exc!r})") from exc
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"{root}: num_attention_heads must be a multiple of num_key_value_heads")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{root}: mlp_bias is not supported")
    if raw.get("quantization_config"):
        method = (
            raw["quantization_config"].get("quant_method")
            if isinstance(raw["quantization_config"], dict)
            else None
        )
        raise UnsupportedModelError(
            f"{root}: quantized checkpoints ({method or 'unknown method'}) are not supported"
        )
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        gen = _read_json(gen_path)
        # generation_config.json is what generate() stops on (Llama 3 lists <|eot_id|> there).
        cfg.eos_token_ids = _as_id_list(gen.get("eos_token_id")) or cfg.eos_token_ids
        cfg.bos_token_id = gen.get("bos_token_id", cfg.bos_token_id)
    return cfg
