"""Attention with a sliding window and soft-capped scores (Gemma 2 and 3) for the torch backend.

The C prefill kernel takes neither a window nor a cap, so the torch backend hands such a layer
here whenever it needs one (`needs_exact_attention`); the Triton backend has them in its prefill
kernel (kernels.prefill_attention). The scores are scaled, capped, masked,
softmaxed in float32 and cast back before the values, in the order transformers computes them, and
only the blocks a sequence's window reaches are read:

- the decode rows of a step (one new token each) go to the C decode kernel on CPU, which starts
  each row at its window's first key and caps the scores in place
  (kernels.cpu_paged_decode_attention); elsewhere they attend a few at a time, their window's
  blocks gathered into a padded batch. Either plan depends only on the step and the window, so it
  is made once per step and reused by every layer with that window;
- a prompt chunk attends on its own, over the blocks its first query's window starts in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from kernels._cpu_paged import heads_contiguous


def needs_exact_attention(metadata: AttentionMetadata, window: int | None, softcap: float | None) -> bool:
    """Whether a layer's attention this step needs this module: soft-capped scores, or a window
    some context is longer than (within it a window masks nothing)."""
    return softcap is not None or (window is not None and metadata.max_seq_len > window)


@dataclass(slots=True)
class _KernelDecodes:
    rows: torch.Tensor  # (decodes,) int64 query rows
    block_tables: torch.Tensor  # (decodes, max_blocks) int32
    seq_lens: torch.Tensor  # (decodes,) int32
    starts: torch.Tensor  # (decodes,) int32: each window's first key


def _plan_kernel_decodes(metadata: AttentionMetadata, window: int | None) -> _KernelDecodes | None:
    rows, seqs, starts = [], [], []
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
        if q_len == 1:
            rows.append(start)
            seqs.append(i)
            starts.append(0 if window is None else max(0, seq_len - window))
        start += q_len
    if not rows:
        return None
    index = torch.tensor(seqs, dtype=torch.long)
    return _KernelDecodes(
        torch.tensor(rows, dtype=torch.long),
        metadata.block_tables.index_select(0, index),
        metadata.seq_lens.index_select(0, index).to(torch.int32),
        torch.tensor(starts, dtype=torch.int32),
    )


@dataclass(slots=True)
class _DecodeGather:
    rows: torch.Tensor  # (decodes,) the query rows
    blocks: torch.Tensor  # (decodes * max_blocks,) int64: each row's window blocks, padded
    hidden: torch.Tensor  # (decodes, max_blocks * block_size) bool: keys outside the window


def _plan_decodes(metadata: AttentionMetadata, window: int | None, block_size: int) -> _DecodeGather | None:
    rows, firsts, counts, seqs, lows, lens = [], [], [], [], [], []
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
        if q_len == 1:
            low = 0 if window is None else max(0, seq_len - window)
            rows.append(start)
            seqs.append(i)
            firsts.append(low // block_size)
            counts.append(-(-seq_len // block_size) - low // block_size)
            lows.append(low)
            lens.append(seq_len)
        start += q_len
    if not rows:
        return None
    device = metadata.block_tables.device
    width = max(counts)
    offsets = torch.arange(width, device=device)
    first = torch.tensor(firsts, device=device)
    columns = (first[:, None] + offsets[None, :]).clamp_(max=metadata.block_tables.shape[1] - 1)
    table = metadata.block_tables[torch.tensor(seqs, device=device)[:, None], columns].to(torch.long)
    table[offsets[None, :] >= torch.tensor(counts, device=device)[:, None]] = 0  # padding: block 0
    positions = first[:, None] * block_size + torch.arange(width * block_size, device=device)[None, :]
    low_t = torch.tensor(lows, device=device)[:, None]
    len_t = torch.tensor(lens, device=device)[:, None]
    return _DecodeGather(
        torch.tensor(rows, device=device), table.reshape(-1), (positions < low_t) | (positions >= len_t)
    )


class WindowedAttention:
    """One per backend: keeps the step's decode gather plans, one per window size."""

    def __init__(self) -> None:
        # Per step's metadata object (two where the windowed layers have a view of their own,
        # AttentionMetadata.windowed), the decode plans by window.
        self._steps: dict[
            int, tuple[AttentionMetadata, dict[int | None, _DecodeGather | _KernelDecodes | None]]
        ] = {}

    def __call__(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), new K/V stored
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None,
        *,
        decode_kernel: bool = False,  # the C decode kernel takes the decode rows (CPU)
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        held = self._steps.get(id(metadata))
        if held is None or held[0] is not metadata:
            if len(self._steps) >= 2:
                self._steps.clear()
            held = self._steps[id(metadata)] = (metadata, {})
        plans = held[1]
        if window not in plans:
            plans[window] = (
                _plan_kernel_decodes(metadata, window)
                if decode_kernel
                else _plan_decodes(metadata, window, k_cache.shape[1])
            )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan = plans[window]
        if isinstance(plan, _KernelDecodes):
            from kernels import cpu_paged_decode_attention as cpu_kernel

            cpu_kernel.paged_decode_attention_cpu(
                heads_contiguous(q),
                k_cache,
                v_cache,
                plan.block_tables,
                plan.seq_lens,
                scale,
                rows=plan.rows,
                out=out,
                starts=plan.starts,
                softcap=softcap,
            )
        elif plan is not None:
            out.index_copy_(0, plan.rows, _decodes(q, k_cache, v_cache, plan, scale, softcap))
        _chunks(q, k_cache, v_cache, metadata, scale, window, softcap, out)
        return out


def _attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hidden: torch.Tensor,
    scale: float,
    softcap,
) -> torch.Tensor:
    """softmax(cap(queries @ keys^T * scale), masked) @ values, the softmax in float32."""
    scores = torch.matmul(queries, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(probs, values)


DECODE_SLICE = 8


def _decodes(q, k_cache, v_cache, gather: _DecodeGather, scale: float, softcap) -> torch.Tensor:
    decodes = gather.rows.numel()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    width = gather.blocks.numel() // decodes
    queries = q.index_select(0, gather.rows).view(decodes, num_kv_heads, group, head_dim)
    out = torch.empty(decodes, q.shape[1], head_dim, dtype=q.dtype, device=q.device)
    # A few rows at a time: one slice's keys and values stay in cache from the gather to the
    # products (all of them at once run slower than a row at a time).
    for lo in range(0, decodes, DECODE_SLICE):
        hi = min(lo + DECODE_SLICE, decodes)
        blocks = gather.blocks[lo * width : hi * width]
        keys = k_cache.index_select(0, blocks).view(hi - lo, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, blocks).view(hi - lo, -1, num_kv_heads, head_dim)
        attended = _attend(
            queries[lo:hi],
            keys.permute(0, 2, 3, 1),  # (rows, kv_heads, head_dim, keys)
            values.transpose(1, 2),  # (rows, kv_heads, keys, head_dim)
            gather.hidden[lo:hi, None, None, :],
            scale,
            softcap,
        )
        out[lo:hi] = attended.reshape(hi - lo, -1, head_dim)
    return out


def _chunks(q, k_cache, v_cache, metadata: AttentionMetadata, scale, window, softcap, out) -> None:
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
        if q_len < 2:
            start += q_len
            continue
        first = seq_len - q_len  # the first query's position
        low = 0 if window is None else max(0, first - window + 1)  # the first key any query sees
        blocks = metadata.block_tables[i, low // block_size : -(-seq_len // block_size)].to(torch.long)
        offset = low % block_size
        keys = k_cache.index_select(0, blocks).flatten(0, 1)[offset : offset + seq_len - low]
        values = v_cache.index_select(0, blocks).flatten(0, 1)[offset : offset + seq_len - low]
        query_pos = torch.arange(first, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(low, seq_len, device=q.device)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        # (kv_heads, group, q_len, head_dim) queries against (kv_heads, 1, head_dim, keys)
        queries = q[start : start + q_len].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        attended = _attend(
            queries, keys.permute(1, 2, 0)[:, None], values.transpose(0, 1)[:, None], hidden, scale, softcap
        )
        out[start : start + q_len] = attended.permute(2, 0, 1, 3).reshape(q_len, -1, head_dim)
        start += q_len
