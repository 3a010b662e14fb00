"""LoRA expand for a batch mixing many adapters: y += s @ B[slot]^T, per token, in place.

Punica's SGMV expand (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024), as used by
S-LoRA (Sheng et al., 2023): the second half of the low-rank update, reading the shrink output s
and adding each token's adapter delta to the base layer's output. Tokens are grouped by slot
(kernels.lora_groups); each (token, column) belongs to exactly one program, so the read-add-write
of y needs no atomics. Base-model rows (slot -1) are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_float, check_int, check_same_device, dot_settings
from kernels.lora_groups import LoraTokenGroups, lora_token_groups


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    s_ptr,
    lora_b_ptr,
    sorted_token_ids_ptr,
    num_tokens_per_slot_ptr,
    slot_start_ptr,
    stride_yt,
    stride_yo,
    stride_st,
    stride_sr,
    stride_bs,
    stride_bo,
    stride_br,
    OUT_DIM: tl.constexpr,
    RANK: tl.constexpr,
    NUM_PID_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    pid_m = pid // NUM_PID_N
    pid_n = pid % NUM_PID_N
    count = tl.load(num_tokens_per_slot_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    group_start = tl.load(slot_start_ptr + slot)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < count
    mask_n = offs_n < OUT_DIM
    tokens = tl.load(sorted_token_ids_ptr + group_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    b_base = lora_b_ptr + slot.to(tl.int64) * stride_bs

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, RANK, BLOCK_K):
        mask_k = k0 + offs_k < RANK
        # (BLOCK_M, BLOCK_K)
        s = tl.load(
            s_ptr + tokens[:, None] * stride_st + (k0 + offs_k)[None, :] * stride_sr,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        # (BLOCK_K, BLOCK_N): B[slot] transposed
        b = tl.load(
            b_base + offs_n[None, :] * stride_bo + (k0 + offs_k)[:, None] * stride_br,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if UPCAST_DOT:
            b = b.to(tl.float32)
        # The float32 shrink output meets B in B's dtype, so half-precision adapters use tensor cores.
        acc += tl.dot(s.to(b.dtype), b, input_precision=DOT_PRECISION)

    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yo
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand(
    y: torch.Tensor,  # (num_tokens, out_dim), updated in place and returned
    s: torch.Tensor,  # (num_tokens, rank), the shrink output (float32 or B's dtype)
    lora_b: torch.Tensor,  # (num_slots, out_dim, rank)
    slot_indices: torch.Tensor,  # (num_tokens,) int, -1 = base model (row untouched)
    *,
    groups: LoraTokenGroups | None = None,
    block_m: int = 32,
) -> torch.Tensor:
    """Add each token's adapter delta to y. Pass `groups` to reuse one step's grouping."""
    check_float("y", y)
    check_float("s", s)
    check_float("lora_b", lora_b)
    check_int("slot_indices", slot_indices)
    check_same_device(y=y, s=s, lora_b=lora_b, slot_indices=slot_indices)
    if y.dim() != 2 or s.dim() != 2 or lora_b.dim() != 3:
        raise ValueError(
            f"y {tuple(y.shape)}, s {tuple(s.shape)}, lora_b {tuple(lora_b.shape)} must be (T, O), (T, R), (S, O, R)"
        )
    num_tokens, out_dim = y.shape
    num_slots, b_out_dim, rank = lora_b.shape
    if s.shape != (num_tokens, rank) or b_out_dim != out_dim:
        raise ValueError(f"s {tuple(s.shape)} and lora_b {tuple(lora_b.shape)} do not fit y {tuple(y.shape)}")
    if slot_indices.shape != (num_tokens,):
        raise ValueError(f"slot_indices must be ({num_tokens},), got {tuple(slot_indices.shape)}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if num_tokens == 0:
        return y
    if groups is None:
        groups = lora_token_groups(slot_indices, num_slots)
    upcast_dot, dot_precision = dot_settings(lora_b.dtype)
    block_n = min(64, max(16, triton.next_power_of_2(out_dim)))
    num_pid_n = triton.cdiv(out_dim, block_n)
    grid = (triton.cdiv(num_tokens, block_m) * num_pid_n, num_slots)
    _lora_expand_kernel[grid](
        y,
        s,
        lora_b,
        groups.sorted_token_ids,
        groups.num_tokens_per_slot,
        groups.slot_start,
        *y.stride(),
        *s.stride(),
        *lora_b.stride(),
        OUT_DIM=out_dim,
        RANK=rank,
        NUM_PID_N=num_pid_n,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(64, max(16, triton.next_power_of_2(rank))),
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
    )
    return y
