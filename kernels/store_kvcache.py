"""Write the new tokens' keys and values into the paged KV cache.

PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023): the cache is a pool of fixed-size blocks, and each token's K/V goes to
the flat slot block_table[p // block_size] * block_size + p % block_size that the model runner
computed for it (slot_mapping). One program copies one token, all of its KV heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_float, check_int, check_same_device


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a row with nothing to store. (The engine's CUDA-graph padding rows do not
    # use it: they write to a scratch block past the pool.) One past the cache would write another
    # tensor's memory; checking it on the host would cost a device sync per layer (and break CUDA
    # graph capture), so it is dropped here like a negative one.
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v, mask=mask)


def store_kvcache(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), any strides (e.g. a view into a fused qkv)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int32/int64; negative slots, and slots past the cache, are skipped
) -> None:
    check_float("k", k)
    check_int("slot_mapping", slot_mapping)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be (num_tokens, num_kv_heads, head_dim), got {k.shape} and {v.shape}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must match, got {k_cache.shape} and {v_cache.shape}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {(num_kv_heads, head_dim)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.dtype != v.dtype:
        raise TypeError(f"k, v and the caches must share a dtype, got {k.dtype}/{v.dtype}/{k_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be ({num_tokens},), got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[0] * k_cache.shape[1],
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
