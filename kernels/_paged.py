"""The paged KV-cache tile load shared by the attention kernels: token positions are mapped through
the sequence's block table to (block, slot) and one K and one V tile of a KV head are read. Positions
past the table row (max_blocks entries) and entries outside the pool (num_blocks blocks) are
masked, so a bad table reads zeros, never memory outside the caches."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_row,
    num_blocks,
    max_blocks,
    pos,
    mask_n,
    offs_d,
    mask_d,
    kv_head,
    stride_btb,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # The block table and its lengths come from the caller, and a check on the host would cost a
    # device sync per call: a position past the table row, or an entry outside the pool, is masked
    # (read as zeros) rather than read out of bounds.
    in_table = mask_n & (pos // BLOCK_SIZE < max_blocks)
    block_ids = tl.load(block_table_row + (pos // BLOCK_SIZE) * stride_btb, mask=in_table, other=0).to(
        tl.int64
    )
    mask_n = in_table & (block_ids >= 0) & (block_ids < num_blocks)
    in_block = pos % BLOCK_SIZE
    k_offs = block_ids * stride_kcb + in_block * stride_kcs + kv_head * stride_kch
    v_offs = block_ids * stride_vcb + in_block * stride_vcs + kv_head * stride_vch
    # (BLOCK_D, BLOCK_N): keys transposed for q @ k
    k = tl.load(
        k_cache_ptr + k_offs[None, :] + offs_d[:, None] * stride_kcd,
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    # (BLOCK_N, BLOCK_D)
    v = tl.load(
        v_cache_ptr + v_offs[:, None] + offs_d[None, :] * stride_vcd,
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
