"""Shared fixtures for the kernel tests: devices, tolerances and random paged batches."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# The kernels run on CPU tensors only inside Triton's interpreter; on a CUDA machine run without it
# (TRITON_INTERPRET=0) the CPU cases are skipped and the `gpu` cases carry the suite.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
DTYPES = [torch.float32, torch.bfloat16]

# float32 agrees to rounding noise (dots are IEEE on GPU too); bfloat16 outputs of magnitude ~1-3
# are one or two ulps (2**-7 relative) away from the float32 reference.
TOLERANCES = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[dtype])


@dataclass
class PagedBatch:
    q: torch.Tensor  # (num_tokens, num_heads, head_dim)
    k: torch.Tensor  # (num_tokens, num_kv_heads, head_dim): the new tokens' keys
    v: torch.Tensor
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim), random everywhere
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # (num_tokens,) int64
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0
    query_lens: list[int]
    seq_lens_list: list[int]

    @property
    def attention_args(self) -> tuple[torch.Tensor, ...]:
        """The leading arguments of a varlen paged attention (kernel or reference): q, the caches,
        where each sequence's queries start, the sequences' lengths and their block tables."""
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables)

    def metadata(self):
        """The attention backends' metadata of this batch."""
        from engine.attention import AttentionMetadata

        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens_list),
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens_list,
        )


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    block_size: int = 16,
    seed: int = 0,
) -> PagedBatch:
    """Sequences whose blocks are scattered over a shuffled pool, the cache filled with random values.

    Every slot holds random data (stale blocks included), so a kernel that reads past a sequence's
    length or through the wrong block gets a visibly wrong answer.
    """
    assert all(1 <= q <= s for q, s in zip(query_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, (n_blocks, q_len, s_len) in enumerate(zip(blocks_per_seq, query_lens, seq_lens, strict=True)):
        table = [pool.pop() for _ in range(n_blocks)]
        block_tables[i, :n_blocks] = torch.tensor(table, dtype=torch.int32)
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)

    num_tokens, num_heads = sum(query_lens), num_kv_heads * group

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens=list(query_lens),
        seq_lens_list=list(seq_lens),
    )


def reference_attention(batch: PagedBatch, scale: float, **kwargs) -> torch.Tensor:
    """The torch reference's attention output for a batch made by make_paged_batch (``window``,
    ``softcap``: see ref_paged_attention)."""
    from kernels.reference import ref_paged_attention

    return ref_paged_attention(*batch.attention_args, scale, **kwargs)


def at_one_and_two_threads(fn, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(*args) run with torch at one thread, then two; the thread count is restored after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(*args)
        torch.set_num_threads(2)
        two = fn(*args)
    finally:
        torch.set_num_threads(before)
    return one, two


def poisoned_caches(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's caches as views into buffers with one NaN block either side: a kernel that reads
    a block outside the pool (index -1 or num_blocks) returns NaN."""
    views = []
    for cache in (batch.k_cache, batch.v_cache):
        buffer = torch.full(
            (cache.shape[0] + 2, *cache.shape[1:]), float("nan"), dtype=cache.dtype, device=cache.device
        )
        buffer[1:-1] = cache
        views.append(buffer[1:-1])
    return views[0], views[1]


def stored_cpu_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    group: int,
    dtype: torch.dtype = torch.float32,
    head_dim: int = 64,
    block_size: int = 16,
    seed: int = 0,
) -> PagedBatch:
    """A CPU batch of three KV heads (make_paged_batch) with its new tokens' keys and values
    already stored in the caches, as the attention backends store them before attending."""
    from kernels.reference import ref_store_kvcache

    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_kv_heads=3,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        block_size=block_size,
        seed=seed,
    )
    ref_store_kvcache(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.slot_mapping)
    return batch
