"""Paged attention with the Triton kernels: the GPU backend (it also runs on CPU under TRITON_INTERPRET=1).

Each step stores the new K/V first, then runs the split-KV decode kernel for decode-only steps and
the varlen prefill kernel otherwise; the prefill kernel treats decode rows as one-token queries, so
mixed batches (chunked prefill beside running decodes) need a single launch. Gemma's windowed and
soft-capped layers take the prefill kernel for every step, with its window and cap.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.attention.windowed import needs_exact_attention
from kernels.paged_decode_attention import paged_decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.store_kvcache import store_kvcache


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, *, decode_split_size: int = 512) -> None:
        # Contexts longer than this are split across programs in decode, so a small batch with long
        # contexts still fills the GPU; shorter ones take the single-pass path with no reduce.
        if decode_split_size < 1:
            raise ValueError(f"decode_split_size must be >= 1, got {decode_split_size}")
        self.decode_split_size = decode_split_size

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        kv_stored: bool = False,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        if not kv_stored:
            store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        # Gemma's window and cap, where a layer needs them this step: the prefill kernel takes both,
        # decode rows included, in one launch. (The choice follows the step's longest context on
        # the host, so engine_setup captures no CUDA graphs for such models.)
        exact = needs_exact_attention(metadata, window, softcap)
        if metadata.is_pure_decode and not exact:
            assert q.shape[0] == metadata.num_seqs, "a decode-only step has one query row per sequence"
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                metadata.seq_lens,
                metadata.block_tables,
                scale,
                max_seq_len=metadata.max_seq_len,
                split_size=self.decode_split_size,
            )
        return prefill_attention(
            q,
            k_cache,
            v_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            max_query_len=metadata.max_query_len,
            window=window if exact else None,
            softcap=softcap,
        )
