"""Fused elementwise ops for the GPU forward, in Triton: the counterparts of kernels.cpu_fused, with
the same signatures, so a decoder layer takes one launch where the torch forms take several.

- ``rms_norm(x, weight, eps, residual_delta=None)``: with a delta, x += delta in place first (the
  decoder layer's residual update), then weight * x / rms(x), one program per row;
- ``silu_mul(gate_up)``: silu(gate) * up of a fused gate|up projection, written at half its width;
- ``rope_and_store_kv(qkv, ...)``: the rotary embedding of q and k in place in the fused q|k|v
  projection, and each token's k and v written into the paged caches, one program per head.

Each rounds where the engine's torch forms round (engine.models.llama: the norm in float32, cast
back before the weight; silu rounded to the dtype before the product; the rotation's two products
and their sum each rounded), so the results agree with them to the last bit or within one rounding
of the input's dtype. An eager decode step of a small model is bound by launches on the host (about
26 per layer with the torch forms, 9 with these); CUDA graphs replay decode steps, these also speed
the prefill and mixed steps, which run eagerly. They run on CPU tensors only under
TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_float, check_int, check_same_device

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and x.dim() == 2 and x.stride(1) == 1


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    dim,
    eps,
    stride_x,
    stride_delta,
    stride_out,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    dtype = out_ptr.dtype.element_ty
    # Arithmetic in float32, rounded to the dtype where the torch forms round (as torch computes a
    # bfloat16 op: in float32, then rounded).
    x32 = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x32 + delta).to(dtype)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
        x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / dim
    normed = (x32 * (1.0 / tl.sqrt(mean_square + eps))).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * normed).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,  # (rows, dim), rows contiguous; updated in place when residual_delta is given
    weight: torch.Tensor,  # (dim,)
    eps: float,
    residual_delta: torch.Tensor | None = None,  # (rows, dim)
) -> torch.Tensor:
    check_float("x", x)
    if (
        not supports(x)
        or weight.dtype != x.dtype
        or weight.shape != (x.shape[1],)
        or not weight.is_contiguous()
    ):
        raise ValueError(f"rms_norm: unsupported x {tuple(x.shape)} {x.dtype} / weight {tuple(weight.shape)}")
    if residual_delta is not None:
        if (
            residual_delta.shape != x.shape
            or residual_delta.dtype != x.dtype
            or residual_delta.stride(1) != 1
        ):
            raise ValueError("rms_norm: residual_delta must be shaped like x, its rows contiguous")
        check_same_device(x=x, weight=weight, residual_delta=residual_delta)
    else:
        check_same_device(x=x, weight=weight)
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x,
        x if residual_delta is None else residual_delta,
        weight,
        out,
        dim,
        float(eps),
        x.stride(0),
        0 if residual_delta is None else residual_delta.stride(0),
        out.stride(0),
        HAS_DELTA=residual_delta is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (rows, 2 * width) -> (rows, width)
    check_float("gate_up", gate_up)
    if not supports(gate_up) or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: unsupported input {tuple(gate_up.shape)} {gate_up.dtype}")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](
        gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rope_and_store_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    k_cache_ptr,
    v_cache_ptr,
    num_slots,
    stride_qkv,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    dtype = qkv_ptr.dtype.element_ty
    first = tl.load(src + offs, mask=mask, other=0.0)
    second = tl.load(src + half + offs, mask=mask, other=0.0)
    if head < NUM_HEADS + NUM_KV_HEADS:
        # x * cos + swap(x) * sin_signed, where swap puts the second half first; each product and
        # the sum rounded to the dtype, as apply_rope_signed's three torch ops round.
        row = token * stride_cos
        cos_first = tl.load(cos_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        cos_second = tl.load(cos_ptr + row + half + offs, mask=mask, other=0.0).to(tl.float32)
        row = token * stride_sin
        sin_first = tl.load(sin_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        sin_second = tl.load(sin_ptr + row + half + offs, mask=mask, other=0.0).to(tl.float32)
        a = first.to(tl.float32)
        b = second.to(tl.float32)
        first = (_rounded(a * cos_first, dtype) + _rounded(b * sin_first, dtype)).to(dtype)
        second = (_rounded(b * cos_second, dtype) + _rounded(a * sin_second, dtype)).to(dtype)
        tl.store(src + offs, first, mask=mask)
        tl.store(src + half + offs, second, mask=mask)
    if head >= NUM_HEADS:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        # Negative slots (nothing to store) and slots past the cache are skipped, as store_kvcache's.
        if (slot >= 0) & (slot < num_slots):
            row = slot * (NUM_KV_HEADS * HEAD_DIM)
            if head >= NUM_HEADS + NUM_KV_HEADS:
                dst = v_cache_ptr + row + (head - NUM_HEADS - NUM_KV_HEADS) * HEAD_DIM
            else:
                dst = k_cache_ptr + row + (head - NUM_HEADS) * HEAD_DIM
            tl.store(dst + offs, first, mask=mask)
            tl.store(dst + half + offs, second, mask=mask)


def rope_and_store_kv(
    qkv: torch.Tensor,  # (tokens, (num_heads + 2 * num_kv_heads) * head_dim), rotated in place
    cos: torch.Tensor,  # (tokens, head_dim)
    sin_signed: torch.Tensor,  # (tokens, head_dim): sin with its first half negated
    slot_mapping: torch.Tensor,  # (tokens,) int32/int64
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), contiguous
    v_cache: torch.Tensor,
    num_heads: int,
) -> None:
    check_float("qkv", qkv)
    check_int("slot_mapping", slot_mapping)
    check_same_device(qkv=qkv, cos=cos, sin_signed=sin_signed, slot_mapping=slot_mapping, k_cache=k_cache)
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if (
        not supports(qkv)
        or head_dim % 2
        or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
        or cos.shape != (tokens, head_dim)
        or sin_signed.shape != cos.shape
        or cos.stride(1) != 1
        or sin_signed.stride(1) != 1
        or {cos.dtype, sin_signed.dtype, k_cache.dtype, v_cache.dtype} != {qkv.dtype}
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape)
        or slot_mapping.shape != (tokens,)
    ):
        raise ValueError(f"rope_and_store_kv: unsupported inputs (qkv {tuple(qkv.shape)} {qkv.dtype})")
    if tokens == 0:
        return
    _rope_and_store_kv_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv,
        cos,
        sin_signed,
        slot_mapping,
        k_cache,
        v_cache,
        k_cache.shape[0] * k_cache.shape[1],
        qkv.stride(0),
        cos.stride(0),
        sin_signed.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
        num_warps=1,
    )
