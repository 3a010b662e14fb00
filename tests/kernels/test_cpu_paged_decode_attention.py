"""The C paged decode attention kernel for the CPU against the slow reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_paged_decode_attention as cpu_kernel
from kernels.reference import ref_store_kvcache
from tests.kernels.helpers import (
    DTYPES,
    assert_close,
    at_one_and_two_threads,
    make_paged_batch,
    reference_attention,
)

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler on this machine")


def _decode_batch(
    seq_lens: list[int],
    *,
    group: int,
    dtype: torch.dtype,
    head_dim: int = 64,
    seed: int = 0,
    block_size: int = 16,
):
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_kv_heads=3,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        seed=seed,
        block_size=block_size,
    )
    ref_store_kvcache(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.slot_mapping)
    return batch


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
