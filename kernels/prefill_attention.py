"""Varlen prefill attention over a paged prefix: chunked prefill, prefix-cache hits and decode rows.

FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", 2023) tiling with online softmax, reading K/V through the block table as in
PagedAttention (Kwon et al., SOSP 2023). Sequence i's query_len new tokens sit at positions
seq_len - query_len .. seq_len - 1; their K/V are already in the cache (the store kernel runs
first), so every query attends over the paged cache with one causal limit: key position <= its own.
A decode row is simply a sequence with query_len 1, so mixed batches need no second kernel.

Gemma's layers: with a sliding window each query sees only its last `window` positions (the key
loop starts at the tile's first window), and with a soft cap the scores become
softcap * tanh(score / softcap) before the softmax, both as transformers computes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import check_float, check_int, check_same_device, dot_settings
from kernels._paged import load_kv_tile

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_blocks", "max_blocks"])
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_blocks,
    max_blocks,
    out_ptr,
    qk_scale,
    sm_scale,
    window,
    softcap,
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
    QUERY_GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid is sized for the longest query in the batch; shorter ones leave tiles idle.
    if pid_m * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    kv_head = head // QUERY_GROUP_SIZE

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < query_len
    mask_d = offs_d < HEAD_DIM
    q_pos = context_len + offs_m  # each query's position in its sequence

    # (BLOCK_M, BLOCK_D)
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bts
    # Keys past the tile's last query are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, context_len + (pid_m + 1) * BLOCK_M)
    kv_start = 0
    if HAS_WINDOW:
        # Keys before the tile's first query's window are masked for every row: start there.
        kv_start = tl.maximum(context_len + pid_m * BLOCK_M - window + 1, 0)

    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + offs_n
        mask_n = pos < kv_end
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

        if HAS_SOFTCAP:
            score = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflowing gives 1).
            capped = softcap * (1.0 - 2.0 / (tl.exp(2.0 * score / softcap) + 1.0))
            qk = capped * 1.4426950408889634  # log2 units
        else:
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        causal = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if HAS_WINDOW:
            causal = causal & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        if HAS_WINDOW:
            # A row may see nothing in a tile before its window starts: -inf - -inf would be NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        else:
            # Position 0 is visible to every row (padded rows included), so the first tile makes m finite.
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_WINDOW:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # padded rows past the query saw no key
    acc = acc / l_i[:, None]
    out_ptrs = (
        out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), sequences back to back
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int: cumulative query lengths from 0
    seq_lens: torch.Tensor,  # (num_seqs,) int: context length including the new tokens
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int
    scale: float,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """Causal attention of every new token over its sequence's paged context; with `window`, over
    its last `window` positions only; with `softcap`, the scores capped (Gemma).

    Pass `max_query_len` (a host int) to avoid a device sync; it sizes the grid.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    check_float("q", q)
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        check_int(name, t)
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
    )
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{num_heads} query heads of dim {head_dim} do not fit {num_kv_heads} KV heads of dim {cache_head_dim}"
        )
    num_seqs = seq_lens.shape[0]
    if (
        query_start_loc.shape != (num_seqs + 1,)
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
    ):
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)} / block_tables {tuple(block_tables.shape)} "
            f"do not match {num_seqs} sequences"
        )
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size is not None and (size < 16 or size & (size - 1)):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {size}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if block_m is None:
        # Small tiles for decode-heavy batches, where most of a 64-row tile would be padding.
        block_m = min(64, max(16, triton.next_power_of_2(max_query_len)))
    upcast_dot, dot_precision = dot_settings(q.dtype)

    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        k_cache.shape[0],
        block_tables.shape[1],
        out,
        scale * LOG2E,
        scale,
        window or 0,
        softcap or 1.0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        QUERY_GROUP_SIZE=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    return out
