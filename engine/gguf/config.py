"""A GGUF file's metadata read as the Hugging Face config.json and generation_config.json it stands for.

GGUF (llama.cpp's format, also what Ollama stores) keeps the hyper-parameters as typed key/value
fields named `<architecture>.<key>`, the tokenizer under `tokenizer.ggml.*` and the chat template
under `tokenizer.chat_template`. The engine serves the Llama decoder layout; GGUF names its
checkpoints `llama` (Llama 1-3, and Mistral as llama.cpp converts it), `mistral`, `qwen2` and
`qwen3` (whose per-head q and k norms are the tensors `attn_q_norm` and `attn_k_norm`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.errors import EngineError

# GGUF architecture name -> (Hugging Face architecture, model_type, Q/K rows permuted by llama.cpp).
# llama.cpp's converter reorders the rows of q_proj and k_proj of Llama-layout models for its
# interleaved rotary embedding; Qwen2 and Qwen3 keep the Hugging Face (neox) order.
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}


class GGUFImportError(EngineError):
    """The GGUF file cannot be imported: unreadable, or a model or encoding the engine does not serve."""


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):
        # GGUF stores float32; 9.999999747e-06 is the 1e-05 the model was trained with.
        value = float(np.float32(value).item())
        value = float(f"{value:.7g}")
    return value


def architecture(reader: Any) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def _int(reader: Any, key: str, default: int | None = None) -> int:
    value = field_value(reader, key, default)
    if isinstance(value, list):
        # Some files give a per-layer list (head counts); the engine needs one value for all layers.
        if len(set(value)) != 1:
            raise GGUFImportError(f"{key} differs between layers ({sorted(set(value))}); not supported")
        value = value[0]
    if value is None:
        raise GGUFImportError(f"the GGUF file has no {key} field")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GGUFImportError(f"{key} must be a positive integer, got {value!r}")
    return value


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, float]) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for Llama 3.1 rope scaling: the divisor of each frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _llama3_candidates(context_length: int) -> list[dict[str, float]]:
    """Llama 3.1 (factor 8) and 3.2 (factor 32) as released, and models scaled the same way: a GGUF
    stores only the resulting per-frequency factors, so the parameters are found by recomputing them."""
    out = []
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        for original in dict.fromkeys((8192, int(context_length // factor))):
            out.append(
                {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": original}
            )  # fmt: skip
    return out


def _rope_scaling(reader: Any, arch: str, head_dim: int, theta: float, rope_freqs: np.ndarray | None):
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if rope_freqs is not None:
        for candidate in _llama3_candidates(_int(reader, f"{arch}.context_length", 8192)):
            expected = llama3_rope_factors(head_dim, theta, candidate)
            if expected.shape == rope_freqs.shape and np.allclose(expected, rope_freqs, rtol=1e-4):
                return {"rope_type": "llama3", **candidate}
        raise GGUFImportError("the GGUF's rope_freqs tensor matches no Llama 3 rope scaling the engine knows")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
    raise GGUFImportError(f"rope scaling {kind!r} is not supported (supported: none, linear, llama3)")


def hf_config(reader: Any, *, dtype: str, vocab_size: int, tied: bool, rope_freqs: np.ndarray | None) -> dict:
    """config.json for the engine's loader and for transformers, from the GGUF's metadata."""
    arch = architecture(reader)
    hf_arch, model_type, _ = ARCHITECTURES[arch]
    hidden = _int(reader, f"{arch}.embedding_length")
    heads = _int(reader, f"{arch}.attention.head_count")
    head_dim = _int(reader, f"{arch}.attention.key_length", hidden // heads)
    theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_dims = field_value(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFImportError(f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    ids = special_token_ids(reader)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _int(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, theta, rope_freqs),
        "max_position_embeddings": _int(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": tied,
        "attention_bias": arch == "qwen2",
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
        "torch_dtype": dtype,
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "mistral":
        config["sliding_window"] = None
    return config


def special_token_ids(reader: Any) -> dict[str, int]:
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
    out = {}
    for short, key in names.items():
        value = field_value(reader, f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            out[short] = value
    return out


def generation_config(reader: Any) -> dict:
    """generation_config.json: what generation stops on (end of text, end of turn, end of message)."""
    ids = special_token_ids(reader)
    stops = list(dict.fromkeys(ids[k] for k in ("eos", "eot", "eom") if k in ids))
    config: dict[str, Any] = {
        "bos_token_id": ids.get("bos"),
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
    }
    pad = field_value(reader, "tokenizer.ggml.padding_token_id")
    if isinstance(pad, int):
        config["pad_token_id"] = pad
    return config
