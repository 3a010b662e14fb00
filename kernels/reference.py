"""Slow, obviously correct torch references for every kernel in this package.

They loop over tokens and walk block tables one position at a time on purpose: kernel and attention
backend tests compare against them. Shapes:

- KV cache, per layer: (num_blocks, block_size, num_kv_heads, head_dim); token position p of a
  sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
- Flattened (varlen) queries: (num_tokens, num_heads, head_dim); sequence i owns rows
  query_start_loc[i]:query_start_loc[i + 1], which are its last query_len positions of seq_lens[i].
- Fused elementwise rows (kernels.cpu_fused): (rows, dim) of float32 or bfloat16.
- LoRA weights stacked by slot: lora_a (num_slots, rank, hidden), lora_b (num_slots, out_dim, rank);
  slot_indices (num_tokens,) picks each token's slot, -1 meaning the base model (no LoRA).
"""

from __future__ import annotations

import torch


def ref_store_kvcache(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int: flat slot per token; negative = padding, skipped
) -> None:
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = k[token]
        v_cache[block, offset] = v[token]


def ref_paged_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int
    seq_lens: torch.Tensor,  # (num_seqs,) int: context length including the new tokens
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim), dtype of q
    """Each new query attends to every cached position up to and including its own (causal), or
    with a `window` to its last `window` positions; with a `softcap` the scores are capped as
    softcap * tanh(score / softcap) before the softmax.

    The new tokens' K/V must already be in the cache. Softmax runs in float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        # Gather this sequence's context position by position through its block table.
        keys, values = [], []
        for pos in range(seq_len):
            block = int(block_tables[i, pos // block_size])
            keys.append(k_cache[block, pos % block_size])  # (num_kv_heads, head_dim)
            values.append(v_cache[block, pos % block_size])
        k_seq = torch.stack(keys).float()  # (seq_len, num_kv_heads, head_dim)
        v_seq = torch.stack(values).float()
        context_len = seq_len - query_len
        for j in range(query_len):
            visible = context_len + j + 1  # causal: positions 0..context_len + j
            first = 0 if window is None else max(0, visible - window)
            for h in range(num_heads):
                kv_head = h // group
                scores = (k_seq[first:visible, kv_head] @ q[q_start + j, h].float()) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                probs = torch.softmax(scores, dim=0)
                out[q_start + j, h] = probs @ v_seq[first:visible, kv_head]
    return out.to(q.dtype)


def ref_lora_shrink(
    x: torch.Tensor,  # (num_tokens, hidden)
    lora_a: torch.Tensor,  # (num_slots, rank, hidden)
    slot_indices: torch.Tensor,  # (num_tokens,) int, -1 = no LoRA
    scale: float | torch.Tensor,  # a float, or (num_slots,) per-slot scaling (alpha / rank)
) -> torch.Tensor:  # (num_tokens, rank) float32, zero rows for base-model tokens
    num_tokens = x.shape[0]
    rank = lora_a.shape[1]
    out = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    for token, slot in enumerate(slot_indices.tolist()):
        if slot < 0:
            continue
        s = float(scale[slot]) if isinstance(scale, torch.Tensor) else float(scale)
        out[token] = (lora_a[slot].float() @ x[token].float()) * s
    return out


def ref_lora_expand(
    y: torch.Tensor,  # (num_tokens, out_dim), updated in place and returned
    s: torch.Tensor,  # (num_tokens, rank), the shrink output
    lora_b: torch.Tensor,  # (num_slots, out_dim, rank)
    slot_indices: torch.Tensor,  # (num_tokens,) int, -1 = no LoRA (row left untouched)
) -> torch.Tensor:
    for token, slot in enumerate(slot_indices.tolist()):
        if slot < 0:
            continue
        delta = lora_b[slot].float() @ s[token].float()  # (out_dim,)
        y[token] = (y[token].float() + delta).to(y.dtype)
    return y


def ref_rms_norm(
    x: torch.Tensor,  # (rows, dim)
    weight: torch.Tensor,  # (dim,)
    eps: float,
    residual_delta: torch.Tensor | None = None,  # (rows, dim): x += delta in place first
) -> torch.Tensor:  # (rows, dim), x's dtype
    """weight * x / rms(x), normalised in float32 and cast back before the weight (transformers'
    LlamaRMSNorm), one row at a time."""
    if residual_delta is not None:
        x.add_(residual_delta)
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        x32 = x[row].float()
        out[row] = weight * (x32 / torch.sqrt(x32.pow(2).mean() + eps)).to(x.dtype)
    return out


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (rows, 2 * width) -> (rows, width)
    """silu(gate) * up of a fused gate|up projection, computed in float32 from the definition
    silu(g) = g / (1 + exp(-g)), then cast to the input's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (gate / (1.0 + torch.exp(-gate)) * up).to(gate_up.dtype)


def ref_rope_and_store_kv(
    qkv: torch.Tensor,  # (tokens, (num_heads + 2 * num_kv_heads) * head_dim), rotated in place
    cos: torch.Tensor,  # (tokens, head_dim)
    sin_signed: torch.Tensor,  # (tokens, head_dim): sin with its first half negated
    slot_mapping: torch.Tensor,  # (tokens,) int
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,
    num_heads: int,
) -> None:
    """The half-split rotary embedding of every q and k head of each token (x * cos + swap(x) *
    sin_signed, swap putting the second half first, rounded as the input's dtype), then each
    token's k and v stored at its slot (ref_store_kvcache)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    half = head_dim // 2
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    for token in range(heads.shape[0]):
        for head in range(num_heads + num_kv_heads):
            x = heads[token, head].clone()
            swapped = torch.cat([x[half:], x[:half]])
            heads[token, head] = x * cos[token] + swapped * sin_signed[token]
    k = heads[:, num_heads : num_heads + num_kv_heads]
    v = heads[:, num_heads + num_kv_heads :]
    ref_store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def ref_moe_grouped_gemm(
    x: torch.Tensor,  # (rows, in), sorted by expert
    w: torch.Tensor,  # (experts, out, in)
    counts: list[int],  # rows per expert
) -> torch.Tensor:  # (rows, out), x's dtype
    """Each expert's block of rows times its weight, one plain matmul per expert in float32."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        block = x[start : start + count].float()
        out[start : start + count] = (block @ w[expert].float().T).to(x.dtype)
        start += count
    return out
