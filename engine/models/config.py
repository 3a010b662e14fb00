"""What the engine needs to know about a checkpoint, read from its config.json and generation_config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.rules import (
    SERVED_ARCHITECTURES,
    model_context_length,
    served_architecture,
    sliding_window_in_use,
)

# Architectures served by engine.models.llama; all share the Llama decoder layout.
SUPPORTED_ARCHITECTURES = SERVED_ARCHITECTURES
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def max_model_len(self) -> int:
        # The rule the web tier applies too (engine.rules.model_context_length).
        return model_context_length(
            {"max_position_embeddings": self.max_position_embeddings, "sliding_window": self.sliding_window}
        )


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
}


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters (theta inside); older checkpoints (every Llama 3.1 on
    # the hub) write rope_theta beside rope_scaling.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
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
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{root}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    try:
        hidden, heads = _positive(raw, "hidden_size"), _positive(raw, "num_attention_heads")
        theta, scaling = _rope(raw)
        window = sliding_window_in_use(raw)
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=_positive(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=_positive(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_positive(raw, "num_key_value_heads", heads),
            head_dim=_positive(raw, "head_dim", hidden // heads),
            intermediate_size=_positive(raw, "intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_positive(raw, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            qk_norm=arch == "Qwen3ForCausalLM",
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
