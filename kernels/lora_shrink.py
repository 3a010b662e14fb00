"""LoRA shrink for a batch mixing many adapters: s = scale * x @ A[slot]^T, per token.

Punica's SGMV shrink (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024), as used by
S-LoRA (Sheng et al., 2023): tokens are grouped by adapter slot (kernels.lora_groups) and each
program multiplies a tile of one slot's tokens by that slot's A, so one launch serves every adapter
in the batch. Base-model tokens (slot -1) get zero rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_float, check_int, check_same_device, dot_settings
from kernels.lora_groups import LoraTokenGroups, lora_token_groups


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    lora_a_ptr,
    out_ptr,
    sorted_token_ids_ptr,
    num_tokens_per_slot_ptr,
    slot_start_ptr,
    slot_scale_ptr,
    scale,
    stride_xt,
    stride_xh,
    stride_as,
    stride_ar,
    stride_ah,
    stride_ot,
    stride_or,
    HIDDEN: tl.constexpr,
    RANK: tl.constexpr,
    NUM_PID_N: tl.constexpr,
    HAS_SLOT_SCALE: tl.constexpr,
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
    # The grid is sized for every token landing in one slot, without a host sync; most tiles idle.
    if pid_m * BLOCK_M >= count:
        return
    group_start = tl.load(slot_start_ptr + slot)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < count
    mask_n = offs_n < RANK
    tokens = tl.load(sorted_token_ids_ptr + group_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    a_base = lora_a_ptr + slot.to(tl.int64) * stride_as

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        mask_k = k0 + offs_k < HIDDEN
        # (BLOCK_M, BLOCK_K)
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + (k0 + offs_k)[None, :] * stride_xh,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        # (BLOCK_K, BLOCK_N): A[slot] transposed
        a = tl.load(
            a_base + offs_n[None, :] * stride_ar + (k0 + offs_k)[:, None] * stride_ah,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if UPCAST_DOT:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)

    if HAS_SLOT_SCALE:
        acc = acc * tl.load(slot_scale_ptr + slot)
    else:
        acc = acc * scale
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + offs_n[None, :] * stride_or
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


def lora_shrink(
    x: torch.Tensor,  # (num_tokens, hidden)
    lora_a: torch.Tensor,  # (num_slots, rank, hidden), same dtype as x
    slot_indices: torch.Tensor,  # (num_tokens,) int, -1 = base model
    scale: float | torch.Tensor,  # a float, or (num_slots,) float32 per-slot scaling (alpha / rank)
    *,
    groups: LoraTokenGroups | None = None,
    block_m: int = 32,
) -> torch.Tensor:  # (num_tokens, rank) float32; zero rows for base-model tokens
    """Project each token onto its adapter's rank-r subspace. Pass `groups` to reuse one step's grouping."""
    check_float("x", x)
    check_int("slot_indices", slot_indices)
    check_same_device(x=x, lora_a=lora_a, slot_indices=slot_indices)
    if x.dim() != 2 or lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and lora_a {tuple(lora_a.shape)} must be (T, H) and (S, R, H)")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"x and lora_a must share a dtype, got {x.dtype} and {lora_a.dtype}")
    num_tokens, hidden = x.shape
    num_slots, rank, _ = lora_a.shape
    if slot_indices.shape != (num_tokens,):
        raise ValueError(f"slot_indices must be ({num_tokens},), got {tuple(slot_indices.shape)}")
    has_slot_scale = isinstance(scale, torch.Tensor)
    if isinstance(scale, torch.Tensor):
        if scale.shape != (num_slots,) or scale.dtype != torch.float32 or scale.device != x.device:
            raise ValueError(f"a per-slot scale must be ({num_slots},) float32 on {x.device}")
        slot_scale = scale
    else:
        slot_scale = torch.empty(1, dtype=torch.float32, device=x.device)  # unread placeholder
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    out = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    if groups is None:
        groups = lora_token_groups(slot_indices, num_slots)
    upcast_dot, dot_precision = dot_settings(x.dtype)
    block_n = min(64, max(16, triton.next_power_of_2(rank)))
    num_pid_n = triton.cdiv(rank, block_n)
    grid = (triton.cdiv(num_tokens, block_m) * num_pid_n, num_slots)
    _lora_shrink_kernel[grid](
        x,
        lora_a,
        out,
        groups.sorted_token_ids,
        groups.num_tokens_per_slot,
        groups.slot_start,
        slot_scale,
        0.0 if has_slot_scale else float(scale),
        *x.stride(),
        *lora_a.stride(),
        *out.stride(),
        HIDDEN=hidden,
        RANK=rank,
        NUM_PID_N=num_pid_n,
        HAS_SLOT_SCALE=has_slot_scale,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(128, max(16, triton.next_power_of_2(hidden))),
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
    )
    return out
