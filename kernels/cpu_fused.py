"""Fused elementwise ops for the CPU forward, in C (kernels/cpu/fused_elementwise.c).

- ``rms_norm(x, weight, eps, residual_delta=None)``: with a delta, x += delta in place first (the
  decoder layer's residual update), then weight * x / rms(x), one pass over each row.
- ``silu_mul(gate_up)``: silu(gate) * up of a fused gate|up projection, written at half its width.
- ``rope_and_store_kv(qkv, ...)``: the rotary embedding of q and k in place in the fused q|k|v
  projection, bit for bit as engine.models.llama.apply_rope_signed, and each token's k and v
  written into the paged caches (engine.attention.torch_backend.store_kv), in one pass.

Their references are kernels.reference's ref_rms_norm, ref_silu_mul and ref_rope_and_store_kv;
the engine's own torch forms (engine.models.llama) are what they replace. `available()` is False where the library cannot be built, and callers keep to those forms.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import _cpu_build

_SIGNATURES = {
    "rms_norm": (
        None,
        [
            ctypes.c_void_p,  # x (updated in place when delta is given)
            ctypes.c_void_p,  # delta (nullable)
            ctypes.c_void_p,  # weight
            ctypes.c_void_p,  # out
            ctypes.c_int64,  # rows
            ctypes.c_int64,  # dim
            ctypes.c_float,  # eps
            ctypes.c_int,  # is_bf16
            ctypes.c_int,  # num_threads
        ],
    ),
    "silu_mul": (
        None,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int],
    ),
    "rope_and_store_kv": (
        ctypes.c_int,
        [
            ctypes.c_void_p,  # qkv (rotated in place)
            ctypes.c_void_p,  # cos
            ctypes.c_void_p,  # sin_signed
            ctypes.c_void_p,  # slots (int64)
            ctypes.c_void_p,  # k_cache
            ctypes.c_void_p,  # v_cache
            ctypes.c_int64,  # num_slots (token rows of each cache)
            ctypes.c_int64,  # tokens
            ctypes.c_int,  # num_heads
            ctypes.c_int,  # num_kv_heads
            ctypes.c_int,  # head_dim
            ctypes.c_int,  # is_bf16
            ctypes.c_int,  # num_threads
        ],
    ),
}
_DTYPES = (torch.float32, torch.bfloat16)
# Widest row (hidden or intermediate size) the kernels' per-row scratch holds at once; wider rows
# are taken a chunk of this width at a time.
MAX_ROW = 16384


def _load() -> ctypes.CDLL | None:
    return _cpu_build.load("fused_elementwise", _SIGNATURES)


def available() -> bool:
    return _load() is not None


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.is_contiguous()


def rms_norm(
    x: torch.Tensor,  # (rows, dim), contiguous; updated in place when residual_delta is given
    weight: torch.Tensor,  # (dim,)
    eps: float,
    residual_delta: torch.Tensor | None = None,  # (rows, dim)
) -> torch.Tensor:
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU fused kernels are not available")
    if (
        not supports(x)
        or weight.dtype != x.dtype
        or weight.shape != (x.shape[1],)
        or not weight.is_contiguous()
    ):
        raise ValueError(f"rms_norm: unsupported x {tuple(x.shape)} {x.dtype} / weight {tuple(weight.shape)}")
    if residual_delta is not None:
        if residual_delta.shape != x.shape or residual_delta.dtype != x.dtype:
            raise ValueError("rms_norm: residual_delta must be shaped like x")
        residual_delta = residual_delta.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm(
        x.data_ptr(),
        None if residual_delta is None else residual_delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        float(eps),
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (rows, 2 * width) -> (rows, width)
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU fused kernels are not available")
    if not supports(gate_up) or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: unsupported input {tuple(gate_up.shape)} {gate_up.dtype}")
    width = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], width), dtype=gate_up.dtype)
    lib.silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        gate_up.shape[0],
        width,
        int(gate_up.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def rope_and_store_kv(
    qkv: torch.Tensor,  # (tokens, (num_heads + 2 * num_kv_heads) * head_dim), rotated in place
    cos: torch.Tensor,  # (tokens, head_dim)
    sin_signed: torch.Tensor,  # (tokens, head_dim): sin with its first half negated
    slot_mapping: torch.Tensor,  # (tokens,) int64
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    num_heads: int,
) -> None:
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU fused kernels are not available")
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if (
        not supports(qkv)
        or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
        or cos.shape != (tokens, head_dim)
        or sin_signed.shape != cos.shape
        or not (cos.is_contiguous() and sin_signed.is_contiguous())
        or {cos.dtype, sin_signed.dtype, k_cache.dtype, v_cache.dtype} != {qkv.dtype}
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape)
        or slot_mapping.dtype != torch.int64
        or slot_mapping.shape != (tokens,)
    ):
        raise ValueError(f"rope_and_store_kv: unsupported inputs (qkv {tuple(qkv.shape)} {qkv.dtype})")
    slot_mapping = slot_mapping.contiguous()
    status = lib.rope_and_store_kv(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        slot_mapping.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[0] * k_cache.shape[1],
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        int(qkv.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status == 2:
        raise IndexError(
            f"rope_and_store_kv: a slot lies outside the KV cache's {k_cache.shape[0] * k_cache.shape[1]} "
            "slots (nothing was written)"
        )
    if status != 0:
        raise ValueError(f"rope_and_store_kv: head_dim {head_dim} is beyond the kernel's limit (512, even)")
