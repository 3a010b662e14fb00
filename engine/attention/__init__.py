"""Attention over the paged KV cache: the per-step metadata and the backend interface.

KV cache layout, per layer: k_cache and v_cache of shape (num_blocks, block_size, num_kv_heads, head_dim).
A token at position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.

One step is one flattened (varlen) batch: sequence i contributes query_lens[i] new tokens (a prefill
chunk, or 1 for a decode), laid out back to back; seq_lens[i] counts the whole context including
those new tokens, so the first seq_lens[i] - query_lens[i] tokens are already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot for each new token's K/V
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative query_lens, starts at 0
    seq_lens: torch.Tensor  # (num_seqs,) int32: context length including the new tokens
    block_tables: torch.Tensor  # (num_seqs, max_num_blocks_per_seq) int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that loop per sequence (the torch reference) without syncing.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Stores the new K/V into the cache, then attends each new query causally over its context."""

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        kv_stored: bool = False,  # the caller already wrote k and v into the caches (a fused pass)
        window: int | None = None,  # a sliding window: each query sees its last `window` keys
        softcap: float | None = None,  # scores soft-capped as softcap * tanh(score / softcap)
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        ...


def needs_exact_attention(metadata: AttentionMetadata, window: int | None, softcap: float | None) -> bool:
    """Whether a layer's attention this step needs windowed_attention: soft-capped scores, or a
    window some context is longer than (within it a window masks nothing)."""
    return softcap is not None or (window is not None and metadata.max_seq_len > window)


def windowed_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), the new K/V stored
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """Causal attention over the paged cache with a sliding window and soft-capped scores (Gemma 2
    and 3), one sequence at a time in plain torch on any device: scores scaled, capped, masked,
    softmaxed in float32 and cast back before the values, in the order transformers computes them.
    Only the blocks a sequence's window reaches are read."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
        if q_len == 0:
            continue
        first = seq_len - q_len  # the first query's position
        low = 0 if window is None else max(0, first - window + 1)  # the first key any query sees
        blocks = metadata.block_tables[i, low // block_size : -(-seq_len // block_size)].to(torch.long)
        offset = low % block_size
        keys = k_cache.index_select(0, blocks).flatten(0, 1)[offset : offset + seq_len - low]
        values = v_cache.index_select(0, blocks).flatten(0, 1)[offset : offset + seq_len - low]
        # (num_kv_heads, group, q_len, head_dim) queries against (num_kv_heads, 1, keys, head_dim)
        queries = q[start : start + q_len].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(queries, keys.permute(1, 2, 0)[:, None]) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(first, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(low, seq_len, device=q.device)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attended = torch.matmul(probs, values.transpose(0, 1)[:, None])  # (kv_heads, group, q_len, d)
        out[start : start + q_len] = attended.permute(2, 0, 1, 3).reshape(q_len, -1, head_dim)
        start += q_len
    return out
