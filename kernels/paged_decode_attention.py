"""Decode attention over the paged KV cache: one new query token per sequence, GQA, split-KV.

PagedAttention (Kwon et al., SOSP 2023) for the block-table walk, with the split-KV scheme of
FlashDecoding (Dao et al., 2023) and PagedAttention v2: a long context is cut into splits of
`split_size` tokens processed by separate programs, each leaving a partial output normalised by
its own softmax sum plus its log-sum-exp; a reduce kernel merges the splits. One program serves a
whole GQA group (every query head sharing one KV head), so each K/V tile is read once per group.
Online softmax (FlashAttention-2, Dao 2023) runs in base 2 with scale * log2(e) folded in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_float, check_int, check_same_device, dot_settings
from kernels._paged import load_kv_tile

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_blocks", "max_blocks"])
def _paged_decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_blocks,
    max_blocks,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_bts,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pos,
    stride_poh,
    stride_posp,
    stride_pod,
    stride_pls,
    stride_plh,
    stride_plsp,
    QUERY_GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * SPLIT_SIZE
    # Shorter sequences in the batch leave their trailing splits empty; a row with seq_len 0 has none.
    if split_start >= seq_len:
        return
    split_end = tl.minimum(split_start + SPLIT_SIZE, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * QUERY_GROUP_SIZE + offs_g
    mask_g = offs_g < QUERY_GROUP_SIZE
    mask_d = offs_d < HEAD_DIM

    # (BLOCK_G, BLOCK_D): the group's query heads, padded up to a tl.dot-sized tile with zero rows.
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bts

    for start in range(split_start, split_end, BLOCK_N):
        pos = start + offs_n
        mask_n = pos < split_end
        k, v = load_kv_tile(
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
            BLOCK_SIZE,
            UPCAST_DOT,
        )

        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N), log2 units
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        # The split's first tile always holds a valid key, so m_new is finite from the first step on.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    mask_out = mask_g[:, None] & mask_d[None, :]
    if not WRITE_PARTIAL:
        out_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        part_ptrs = (
            part_out_ptr
            + seq * stride_pos
            + heads[:, None] * stride_poh
            + split * stride_posp
            + offs_d[None, :] * stride_pod
        )
        tl.store(part_ptrs, acc, mask=mask_out)
        lse = m_i + tl.log2(l_i)  # log2-sum-exp2 of this split's scaled scores
        tl.store(part_lse_ptr + seq * stride_pls + heads * stride_plh + split * stride_plsp, lse, mask=mask_g)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_pos,
    stride_poh,
    stride_posp,
    stride_pod,
    stride_pls,
    stride_plh,
    stride_plsp,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if seq_len == 0:
        return
    num_valid_splits = tl.cdiv(seq_len, SPLIT_SIZE)

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_valid_splits
    mask_d = offs_d < HEAD_DIM
    # Empty splits wrote nothing: they are masked to -inf here and weigh exactly zero.
    lse = tl.load(
        part_lse_ptr + seq * stride_pls + head * stride_plh + offs_s * stride_plsp,
        mask=mask_s,
        other=float("-inf"),
    )
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # (BLOCK_S,)
    weights = weights / tl.sum(weights, axis=0)
    # (BLOCK_S, BLOCK_D): each split's normalised partial output
    parts = tl.load(
        part_out_ptr
        + seq * stride_pos
        + head * stride_poh
        + offs_s[:, None] * stride_posp
        + offs_d[None, :] * stride_pod,
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], axis=0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim): one new token per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # (num_seqs,) int: context length including the new token
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int
    scale: float,
    *,
    max_seq_len: int | None = None,
    split_size: int = 512,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim); rows with seq_len 0 are left unwritten
    """Attend each sequence's single new query over its whole cached context (the new K/V included).

    Contexts longer than `split_size` tokens are split across programs and merged by a reduce step.
    Pass `max_seq_len` (a host int) to avoid a device sync; it fixes the number of splits.
    """
    check_float("q", q)
    check_int("seq_lens", seq_lens)
    check_int("block_tables", block_tables)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables)
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{num_heads} query heads of dim {head_dim} do not fit {num_kv_heads} KV heads of dim {cache_head_dim}"
        )
    if seq_lens.shape != (num_seqs,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} / block_tables {tuple(block_tables.shape)} do not match {num_seqs} sequences"
        )
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    num_splits = max(1, triton.cdiv(max_seq_len, split_size))
    group = num_heads // num_kv_heads
    upcast_dot, dot_precision = dot_settings(q.dtype)
    block_n = min(64, max(16, triton.next_power_of_2(split_size)))
    block_d = max(16, triton.next_power_of_2(head_dim))

    if num_splits > 1:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # the kernel writes `out` directly; these are never touched
        part_out = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)

    _paged_decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        k_cache.shape[0],
        block_tables.shape[1],
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        *part_out.stride(),
        *part_lse.stride(),
        QUERY_GROUP_SIZE=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SPLIT_SIZE=split_size,
        # A flag rather than the split count, so a growing max_seq_len does not recompile the kernel.
        WRITE_PARTIAL=num_splits > 1,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            seq_lens,
            out,
            *part_out.stride(),
            *part_lse.stride(),
            *out.stride(),
            HEAD_DIM=head_dim,
            SPLIT_SIZE=split_size,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
