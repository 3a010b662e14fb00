"""The C paged prefill attention kernel for the CPU against the slow reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_paged_prefill_attention as cpu_prefill
from tests.kernels.helpers import (
    DTYPES,
    assert_close,
    at_one_and_two_threads,
    reference_attention,
    stored_cpu_batch,
)

pytestmark = [
    pytest.mark.skipif(not cpu_prefill.available(), reason="no C compiler on this machine"),
    pytest.mark.usefixtures("cpu_kernel_build"),
]


_batch = stored_cpu_batch


def _chunks(batch) -> cpu_prefill.ChunkTable:
    starts = batch.query_start_loc.tolist()[:-1]
    return cpu_prefill.ChunkTable(
        list(range(len(batch.query_lens))), starts, batch.query_lens, batch.seq_lens_list
    )


# (query_lens, seq_lens): fresh prompts (q_len == seq_len) shorter and longer than a query tile and
# a 64-key softmax block, chunks that follow cached tokens (a warm prefix), a chunk of two tokens,
# and several chunks in one call; partial last blocks throughout.
CHUNKS = [
    ([5], [5]),
    ([128], [128]),
    ([2], [300]),
    ([32], [1056]),
    ([17, 64, 3], [17, 200, 3]),
    ([65, 40, 9], [65, 41, 129]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(("query_lens", "seq_lens"), CHUNKS)
def test_the_kernel_matches_the_reference_on_prompt_chunks(dtype, group, head_dim, query_lens, seq_lens):
    # given prompt chunks whose contexts lie in blocks scattered over a shuffled pool
    batch = _batch(query_lens, seq_lens, group=group, dtype=dtype, head_dim=head_dim)
    expected = reference_attention(batch, 0.125)

    # when the kernel attends causally, in place over the paged cache
    out = cpu_prefill.paged_prefill_attention_cpu(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, _chunks(batch), 0.125
    )

    # then every row equals the reference within the dtype's tolerance
    assert out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_any_power_of_two_block_size_is_read_through_the_block_table(block_size):
    batch = _batch([20, 50], [90, 50], group=3, block_size=block_size, seed=4)
    out = cpu_prefill.paged_prefill_attention_cpu(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, _chunks(batch), 0.3
    )
    assert_close(out, reference_attention(batch, 0.3), torch.float32)


def test_chunks_write_their_own_rows_and_leave_the_others():
    # given two chunks whose queries sit at rows 3-8 and 12-15 of a 20-row step whose other rows
    # are decodes, the queries a view into a wider projection (rows apart, heads contiguous)
    batch = _batch([6, 4], [40, 4], group=3, seed=2)
    num_heads, head_dim = batch.q.shape[1:]
    wide = torch.randn(20, num_heads * head_dim + 96)
    q = wide[:, : num_heads * head_dim].view(20, num_heads, head_dim)
    q[3:9] = batch.q[:6]
    q[12:16] = batch.q[6:]
    out = torch.full((20, num_heads, head_dim), 7.0)
    chunks = cpu_prefill.ChunkTable([0, 1], [3, 12], [6, 4], [40, 4])

    # when the kernel writes through the chunk table
    cpu_prefill.paged_prefill_attention_cpu(
        q, batch.k_cache, batch.v_cache, batch.block_tables, chunks, 0.125, out=out
    )

    # then the chunks' rows hold the attention and every other row is untouched
    expected = reference_attention(batch, 0.125)
    assert_close(out[3:9], expected[:6], torch.float32)
    assert_close(out[12:16], expected[6:], torch.float32)
    others = [i for i in range(20) if not (3 <= i < 9 or 12 <= i < 16)]
    assert torch.equal(out[others], torch.full_like(out[others], 7.0))


def test_the_result_does_not_depend_on_the_number_of_threads():
    batch = _batch([100, 7, 33], [100, 300, 90], group=3, seed=5)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, _chunks(batch), 0.125)
    one, two = at_one_and_two_threads(cpu_prefill.paged_prefill_attention_cpu, *args)
    assert torch.equal(one, two)


def test_bad_inputs_are_refused_before_the_kernel_runs():
    batch = _batch([20, 30], [20, 60], group=3)
    chunks = _chunks(batch)
    with pytest.raises(ValueError, match="int32"):
        cpu_prefill.paged_prefill_attention_cpu(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables.long(), chunks, 0.1
        )
    with pytest.raises(ValueError, match="run past q"):
        cpu_prefill.paged_prefill_attention_cpu(
            batch.q[:30], batch.k_cache, batch.v_cache, batch.block_tables, chunks, 0.1
        )
    with pytest.raises(ValueError, match="unsupported"):
        cpu_prefill.paged_prefill_attention_cpu(
            batch.q.half(), batch.k_cache.half(), batch.v_cache.half(), batch.block_tables, chunks, 0.1
        )
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        cpu_prefill.ChunkTable([0], [0], [5], [4])


@pytest.mark.parametrize("bad_block", [-1, -(2**31), "num_blocks", 2**31 - 1])
def test_a_block_table_entry_outside_the_pool_is_refused_before_anything_is_read(bad_block):
    # given a chunk whose context's last block names a block outside the pool
    batch = _batch([20, 30], [20, 60], group=3)
    tables = batch.block_tables.clone()
    tables[1, 3] = batch.k_cache.shape[0] if bad_block == "num_blocks" else bad_block
    out = torch.full(batch.q.shape, 7.0)

    with pytest.raises(IndexError, match="block table entry"):
        cpu_prefill.paged_prefill_attention_cpu(
            batch.q, batch.k_cache, batch.v_cache, tables, _chunks(batch), 0.1, out=out
        )
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_a_chunk_context_longer_than_its_block_table_row_is_refused():
    batch = _batch([20, 30], [20, 60], group=3)  # rows of 4 entries: 64 tokens at most
    chunks = cpu_prefill.ChunkTable([0, 1], [0, 20], [20, 30], [20, 65])
    out = torch.full(batch.q.shape, 7.0)

    with pytest.raises(ValueError, match="context length"):
        cpu_prefill.paged_prefill_attention_cpu(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, chunks, 0.1, out=out
        )
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_a_chunk_naming_a_negative_sequence_or_row_is_refused():
    with pytest.raises(ValueError, match="negative"):
        cpu_prefill.ChunkTable([-1], [0], [5], [5])
    with pytest.raises(ValueError, match="negative"):
        cpu_prefill.ChunkTable([0], [-3], [5], [5])
