"""The rotary embedding's config.json fields, from what llama.cpp keeps of them.

llama.cpp turns a checkpoint's rope scaling into what its kernels read: Llama 3's into the tensor
`rope_freqs` (the divisor of each frequency), Phi-3's LongRoPE into the tensors `rope_factors_long`
and `rope_factors_short` beside the fields `rope.scaling.original_context_length` and
`rope.scaling.attn_factor`, linear scaling into fields. A partial rotary embedding (Phi-4-mini turns
3/4 of each head) is `rope.dimension_count` below the head size.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.gguf.fields import GGUFImportError, field_value, int_field

ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
# Tensors that become config, not weights.
ROPE_TENSORS = (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)


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


def _float32_list(values: np.ndarray) -> list[float]:
    # The shortest decimal of each float32 (1.476, not 1.4759999513626099): the same float32 again
    # when the engine or transformers reads it.
    return [float(str(v)) for v in values.astype(np.float32)]


def _longrope(reader: Any, arch: str, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Phi-3's LongRoPE. llama.cpp computes the attention factor from the context's growth when it
    converts and stores the result, which is written as is; a file without it gets the same default
    from the loader."""
    if ROPE_FACTORS_LONG not in tensors or ROPE_FACTORS_SHORT not in tensors:
        raise GGUFImportError(
            "LongRoPE needs both rope_factors_long and rope_factors_short; the file has one"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "short_factor": _float32_list(tensors[ROPE_FACTORS_SHORT]),
        "long_factor": _float32_list(tensors[ROPE_FACTORS_LONG]),
        "original_max_position_embeddings": int_field(reader, f"{arch}.rope.scaling.original_context_length"),
    }
    attention = field_value(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def rope_scaling(
    reader: Any, arch: str, rotary_dim: int, theta: float, tensors: dict[str, np.ndarray]
) -> dict[str, Any] | None:
    """config.json's rope_scaling; `tensors`: the file's ROPE_TENSORS, dequantized."""
    if ROPE_FACTORS_LONG in tensors or ROPE_FACTORS_SHORT in tensors:
        return _longrope(reader, arch, tensors)
    rope_freqs = tensors.get(ROPE_FREQS)
    if rope_freqs is not None:
        for candidate in _llama3_candidates(int_field(reader, f"{arch}.context_length", 8192)):
            expected = llama3_rope_factors(rotary_dim, theta, candidate)
            if expected.shape == rope_freqs.shape and np.allclose(expected, rope_freqs, rtol=1e-4):
                return {"rope_type": "llama3", **candidate}
        raise GGUFImportError("the GGUF's rope_freqs tensor matches no Llama 3 rope scaling the engine knows")
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
    raise GGUFImportError(
        f"rope scaling {kind!r} is not supported (supported: none, linear, llama3, longrope)"
    )


def partial_rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """config.json's partial_rotary_factor for `rotary_dim` of `head_dim` dims. Readers take
    int(head_dim * factor), and 44 * (30 / 44) is 29.999...: the factor is nudged up until it gives
    `rotary_dim` back."""
    factor = rotary_dim / head_dim
    while int(head_dim * factor) < rotary_dim:
        factor = math.nextafter(factor, 1.0)
    return factor
