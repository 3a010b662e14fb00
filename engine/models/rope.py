"""Rotary position embeddings (RoFormer, arXiv:2104.09864) with Llama 3's and Phi-3's (LongRoPE)
frequency scaling.

The tables are laid out for the half-split form Hugging Face checkpoints are trained with: the first
and second halves of each head are the two coordinates of every rotated pair (the rotation itself is
engine.models.llama.apply_rope_signed).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, *, long_context: bool = False
) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, after linear, llama3 or longrope scaling.
    `head_dim`: the rotated dims of a head. `long_context`: LongRoPE's long factors (a context
    beyond its original_max_position_embeddings) rather than its short ones."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = torch.tensor(
            scaling["long_factor" if long_context else "short_factor"], dtype=torch.float32
        )
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def uses_long_factors(scaling: dict[str, Any] | None, max_model_len: int) -> bool:
    """Whether a LongRoPE model serving contexts of up to `max_model_len` tokens takes its long
    factors, for every position: one table for the whole context, so that a sequence's cached keys
    never change rotation as it grows (vLLM decides the same way)."""
    return (
        scaling is not None
        and scaling["rope_type"] == "longrope"
        and max_model_len > int(scaling["original_max_position_embeddings"])
    )


class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor

    def __init__(
        self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None, *, long_context: bool = False
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling, long_context=long_context)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # LongRoPE scales cos and sin by its attention factor.
        self.attention_scaling = float((scaling or {}).get("attention_factor", 1.0))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float32 whatever the model dtype: bfloat16 positions lose whole rotations past 256.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (num_tokens, rotary_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (num_tokens, rotary_dim)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
