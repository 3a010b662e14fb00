"""The C paged decode attention kernel for the CPU against the slow reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_paged_decode_attention as cpu_kernel
from tests.kernels.helpers import (
    DTYPES,
    assert_close,
    at_one_and_two_threads,
    reference_attention,
    stored_cpu_batch,
)

pytestmark = [
    pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler on this machine"),
    pytest.mark.usefixtures("cpu_kernel_build"),
]


def _decode_batch(seq_lens: list[int], *, group: int, dtype: torch.dtype, head_dim=64, seed=0, block_size=16):
    return stored_cpu_batch(
        [1] * len(seq_lens),
        seq_lens,
        group=group,
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        seed=seed,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(
    "seq_lens", [[1], [15], [63, 1, 300], [16, 17, 32, 33], [(37 * i) % 300 + 1 for i in range(40)]]
)
def test_the_kernel_matches_the_reference_on_decode_rows(dtype, group, head_dim, seq_lens):
    # given decodes whose contexts end in partial blocks scattered over a shuffled pool
    batch = _decode_batch(seq_lens, group=group, dtype=dtype, head_dim=head_dim)
    expected = reference_attention(batch, 0.125)

    # when the kernel attends in place over the paged cache
    out = cpu_kernel.paged_decode_attention_cpu(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125
    )

    # then every row equals the reference within the dtype's tolerance
    assert out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("block_size", [1, 8, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_score_tiles_of_sixteen_tokens_cross_blocks_of_any_size(block_size, head_dim):
    # given contexts that end inside a tile and span blocks smaller and larger than a tile
    batch = _decode_batch(
        [1, 17, 47, 64, 129], group=3, dtype=torch.float32, head_dim=head_dim, block_size=block_size
    )
    expected = reference_attention(batch, 0.125)

    # when the kernel attends
    out = cpu_kernel.paged_decode_attention_cpu(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125
    )

    # then each token was read from its own block
    assert_close(out, expected, torch.float32)


def test_rows_place_each_sequence_in_its_own_row_and_leave_the_others():
    # given four decodes whose queries sit at rows 5, 0, 3 and 7 of an eight-row batch
    batch = _decode_batch([40, 1, 200, 17], group=3, dtype=torch.float32)
    rows = torch.tensor([5, 0, 3, 7])
    q = torch.randn(8, *batch.q.shape[1:])
    q[rows] = batch.q
    out = torch.full_like(q, 7.0)
    expected = reference_attention(batch, 0.125)

    # when the kernel writes through rows
    cpu_kernel.paged_decode_attention_cpu(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125, rows=rows, out=out
    )

    # then the named rows hold the attention and every other row is untouched
    assert_close(out[rows], expected, torch.float32)
    others = [i for i in range(8) if i not in rows.tolist()]
    assert torch.equal(out[others], torch.full_like(out[others], 7.0))


def test_the_result_does_not_depend_on_the_number_of_threads():
    batch = _decode_batch([(53 * i) % 500 + 1 for i in range(24)], group=3, dtype=torch.float32)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    one, two = at_one_and_two_threads(cpu_kernel.paged_decode_attention_cpu, *args)
    assert torch.equal(one, two)


def test_bad_inputs_are_refused_before_the_kernel_runs():
    batch = _decode_batch([20, 30], group=3, dtype=torch.float32)
    with pytest.raises(ValueError, match="int32"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables.long(), batch.seq_lens, 0.1
        )
    with pytest.raises(ValueError, match="one row per sequence"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q[:1], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.1
        )
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q.half(),
            batch.k_cache.half(),
            batch.v_cache.half(),
            batch.block_tables,
            batch.seq_lens,
            0.1,
        )


@pytest.mark.parametrize("bad_block", [-1, -(2**31), "num_blocks", 2**31 - 1])
def test_a_block_table_entry_outside_the_pool_is_refused_before_anything_is_read(bad_block):
    # given a decode whose context's second block names a block outside the pool
    batch = _decode_batch([40, 20], group=3, dtype=torch.float32)
    num_blocks = batch.k_cache.shape[0]
    tables = batch.block_tables.clone()
    tables[0, 1] = num_blocks if bad_block == "num_blocks" else bad_block
    out = torch.full(batch.q.shape, 7.0)

    # when the kernel is called, then it raises and writes nothing
    with pytest.raises(IndexError, match="block table entry"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, 0.1, out=out
        )
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_entries_past_a_context_are_not_read_so_they_may_hold_anything():
    batch = _decode_batch([40, 20], group=3, dtype=torch.float32)
    width = batch.block_tables.shape[1]
    tables = torch.cat([batch.block_tables, torch.full((2, 2), -1, dtype=torch.int32)], dim=1)
    tables[1, 2:width] = 10**6  # sequence 1 (20 tokens) reads its first two entries only

    out = cpu_kernel.paged_decode_attention_cpu(
        batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, 0.125
    )

    assert_close(out, reference_attention(batch, 0.125), torch.float32)
    # and one token more than sequence 1's first two entries cover is refused
    with pytest.raises(IndexError, match="block table entry"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q, batch.k_cache, batch.v_cache, tables, torch.tensor([40, 33], dtype=torch.int32), 0.1
        )


@pytest.mark.parametrize("seq_len", [4 * 16 + 1, 10**6, -1])
def test_a_context_longer_than_its_block_table_row_or_negative_is_refused(seq_len):
    batch = _decode_batch([40, 64], group=3, dtype=torch.float32)  # rows of 4 entries
    assert batch.block_tables.shape[1] == 4
    out = torch.full(batch.q.shape, 7.0)

    with pytest.raises(ValueError, match="context length"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            torch.tensor([40, seq_len], dtype=torch.int32),
            0.1,
            out=out,
        )
    assert torch.equal(out, torch.full_like(out, 7.0))


@pytest.mark.parametrize("bad_row", [-1, 8, 2**40])
def test_a_row_outside_q_is_refused(bad_row):
    batch = _decode_batch([20, 30], group=3, dtype=torch.float32)
    q = torch.zeros(8, *batch.q.shape[1:])
    q[[2, 5]] = batch.q
    out = torch.full(q.shape, 7.0)

    with pytest.raises(IndexError, match="query row"):
        cpu_kernel.paged_decode_attention_cpu(
            q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            0.1,
            rows=torch.tensor([2, bad_row]),
            out=out,
        )
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_a_cache_of_another_head_size_is_refused():
    batch = _decode_batch([20, 30], group=3, dtype=torch.float32, head_dim=64)
    small = batch.k_cache[..., :32].contiguous()
    with pytest.raises(ValueError, match="head_dim"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q, small, small.clone(), batch.block_tables, batch.seq_lens, 0.1
        )


def _windowed_reference(batch, scale: float, starts: list[int], softcap: float | None) -> torch.Tensor:
    """Each decode row over its keys from starts[i] on, scores soft-capped, in float32."""
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = batch.q.shape[1] // num_kv_heads
    out = torch.empty(batch.q.shape, dtype=torch.float32)
    for i, (start, seq_len) in enumerate(zip(starts, batch.seq_lens.tolist(), strict=True)):
        slots = [
            int(batch.block_tables[i, t // block_size]) * block_size + t % block_size for t in range(seq_len)
        ]
        keys = batch.k_cache.flatten(0, 1)[slots[start:]].float()  # (keys, kv_heads, head_dim)
        values = batch.v_cache.flatten(0, 1)[slots[start:]].float()
        for h in range(batch.q.shape[1]):
            scores = keys[:, h // group] @ batch.q[i, h].float() * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[i, h] = torch.softmax(scores, dim=0) @ values[:, h // group]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_a_window_and_a_soft_cap_match_the_reference(dtype, head_dim, softcap):
    # given decodes some of which outrun a 20-token window that starts inside a block
    seq_lens = [1, 15, 21, 63, 300, 33]
    batch = _decode_batch(seq_lens, group=3, dtype=dtype, head_dim=head_dim, seed=7)
    starts = [max(0, n - 20) for n in seq_lens]

    # when the kernel attends from each window's first key, scores capped
    out = cpu_kernel.paged_decode_attention_cpu(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125,
        starts=torch.tensor(starts, dtype=torch.int32), softcap=softcap,
    )  # fmt: skip

    # then each row attends to its window alone
    assert_close(out, _windowed_reference(batch, 0.125, starts, softcap), dtype)
    if softcap is None:
        assert not torch.allclose(out.float(), reference_attention(batch, 0.125).float(), atol=1e-3)


def test_a_start_outside_the_context_is_refused():
    batch = _decode_batch([5, 9], group=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="context length"):
        cpu_kernel.paged_decode_attention_cpu(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125,
            starts=torch.tensor([0, 9], dtype=torch.int32),
        )  # fmt: skip
