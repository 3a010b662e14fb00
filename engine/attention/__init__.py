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
    # The same step as the windowed layers see it, where their K/V has a pool of its own
    # (engine.block_manager): their block tables and slots. None: they read these.
    windowed: AttentionMetadata | None = None

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
