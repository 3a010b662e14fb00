"""Paged attention in plain torch: the CPU backend and the reference the Triton backend is tested against.

Decode-only steps (every sequence adds one token) gather all contexts into one padded batch and run a
single scaled_dot_product_attention with a key-padding mask; the grouped query heads of each KV head
ride along as extra query rows, so GQA costs no K/V repeat. Steps with prefill chunks attend per
sequence, with a causal mask offset by the part of the context already in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks]]  # (num_blocks, block_size, num_kv_heads, head_dim)
    return blocks.flatten(0, 1)[:seq_len]  # (seq_len, num_kv_heads, head_dim)


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if metadata.is_pure_decode:
            return self._decode(q, k_cache, v_cache, metadata, scale)
        return self._varlen(q, k, v, k_cache, v_cache, metadata, scale)

    def _decode(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        block_size = k_cache.shape[1]
        max_len = metadata.max_seq_len
        max_blocks = -(-max_len // block_size)
        tables = metadata.block_tables[:, :max_blocks].long()
        # (num_seqs, max_len, num_kv_heads, head_dim) -> (num_seqs, num_kv_heads, max_len, head_dim)
        keys = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        values = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        queries = q.view(num_seqs, num_kv_heads, group, head_dim)
        lens = metadata.seq_lens.to(device=q.device, dtype=torch.long)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # (num_seqs, max_len)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _varlen(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
            end = start + q_len
            if q_len == seq_len:
                # Nothing cached before this chunk: its own K/V are the whole context.
                keys, values = k[start:end], v[start:end]
            else:
                keys = _gather_context(k_cache, metadata.block_tables[i], seq_len)
                values = _gather_context(v_cache, metadata.block_tables[i], seq_len)
            queries = q[start:end].transpose(0, 1)  # (num_heads, q_len, head_dim)
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # (num_kv_heads, seq_len, head_dim)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            if q_len == seq_len:
                o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
            else:
                # Query j sits at absolute position seq_len - q_len + j and sees keys up to there.
                past = seq_len - q_len
                rows = torch.arange(q_len, device=q.device)[:, None] + past
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows  # (q_len, seq_len)
                o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
            out[start:end] = o.transpose(0, 1)
            start = end
        return out
