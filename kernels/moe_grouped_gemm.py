"""Grouped GEMM for a mixture of experts: each expert's weight times the block of rows routed to it.

The rows (token copies, one per chosen expert) are sorted by expert beforehand
(engine.models.moe.SparseMoeBlock.grouped), so expert e owns rows offsets[e]:offsets[e + 1]. One
launch covers every expert: the grid's first axis walks tiles of BLOCK_M rows that never straddle
two experts (a tile table built from the per-expert counts), its second the output columns, and
each program multiplies its rows by its expert's weight, read in place from the stacked
(experts, out, in) tensor, as nn.Linear lays a weight out. Experts no row chose launch nothing.
The torch reference is kernels.reference.ref_moe_grouped_gemm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_float, check_int, check_same_device, dot_settings


@triton.jit
def _moe_grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row_start = tl.load(tile_start_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)  # the end of this expert's rows
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        # (BLOCK_M, BLOCK_K) rows, and the expert's weight transposed: (BLOCK_K, BLOCK_N)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if UPCAST_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tile_table(counts: list[int], block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end of the expert's rows) of every BLOCK_M-row tile, as int32 tensors."""
    experts, starts, ends = [], [], []
    row = 0
    for expert, count in enumerate(counts):
        for start in range(row, row + count, block_m):
            experts.append(expert)
            starts.append(start)
            ends.append(row + count)
        row += count
    # One host-to-device copy for the three columns (each a contiguous row of the table).
    return tuple(torch.tensor([experts, starts, ends], dtype=torch.int32, device=device).unbind(0))


def moe_grouped_gemm(
    x: torch.Tensor,  # (rows, in) sorted by expert
    w: torch.Tensor,  # (experts, out, in), same dtype as x
    counts: list[int],  # rows per expert, in expert order; they sum to rows
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:  # (rows, out), x's dtype
    """out[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]] @ w[e].T for every expert e.

    `block_m`, the rows of a tile, defaults to the busiest expert's rows rounded up to a power of
    two within 16-64: a decode step's few rows per expert waste little of a 16-row tile, a
    prefill's hundreds read each weight tile once per 64 rows instead of once per 16."""
    check_float("x", x)
    check_same_device(x=x, w=w)
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must be (M, K) and (E, N, K)")
    if w.dtype != x.dtype:
        raise TypeError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(
            f"counts must give the rows of each of the {w.shape[0]} experts, {x.shape[0]} in all"
        )
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(max(counts, default=1))))
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    rows, k = x.shape
    n = w.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tile_expert, tile_start, tile_end = tile_table(counts, block_m, x.device)
    check_int("tile_expert", tile_expert)
    upcast_dot, dot_precision = dot_settings(x.dtype)
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _moe_grouped_gemm_kernel[grid](
        x,
        w,
        out,
        tile_expert,
        tile_start,
        tile_end,
        *x.stride(),
        *w.stride(),
        *out.stride(),
        N=n,
        K=k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))),
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
