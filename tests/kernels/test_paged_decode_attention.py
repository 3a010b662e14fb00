from __future__ import annotations

import pytest
import torch

from kernels.paged_decode_attention import paged_decode_attention
from tests.kernels.helpers import (
    DEVICES,
    DTYPES,
    assert_close,
    make_paged_batch,
    poisoned_caches,
    reference_attention,
)

# Context lengths 1, 15, 63 and 300: a lone token, partial last blocks (15 % 16, 63 % 16, 300 % 16).
SEQ_LENS = [1, 15, 63, 300]


def _decode_batch(seq_lens, *, group, dtype, device, head_dim=32, seed=0):
    return make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("split_size", [512, 37], ids=["single-pass", "split-kv"])
def test_decode_matches_the_reference_over_mixed_context_lengths(device, dtype, group, split_size):
    # given four sequences; with split_size 37 the 300-token context spans 9 splits (the last partial)
    # and the shorter ones leave trailing splits empty for the reduce step to ignore
    batch = _decode_batch(SEQ_LENS, group=group, dtype=dtype, device=device, seed=group)
    scale = 32**-0.5

    out = paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.seq_lens,
        batch.block_tables,
        scale,
        split_size=split_size,
    )

    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, reference_attention(batch, scale), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_decode_handles_head_dims_that_are_not_tile_sized(device, head_dim):
    batch = _decode_batch([15, 63], group=4, dtype=torch.float32, device=device, head_dim=head_dim)
    scale = head_dim**-0.5

    out = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, split_size=16
    )

    assert_close(out, reference_attention(batch, scale), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_split_count_follows_the_given_max_seq_len_and_writes_into_out(device):
    # given a max_seq_len above the real maximum (a CUDA-graph bucket), so some splits exist for nobody
    batch = _decode_batch([63, 300], group=4, dtype=torch.float32, device=device)
    out = torch.full_like(batch.q, float("nan"))

    result = paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.seq_lens,
        batch.block_tables,
        0.2,
        max_seq_len=512,
        split_size=64,
        out=out,
    )

    assert result.data_ptr() == out.data_ptr()
    assert_close(out, reference_attention(batch, 0.2), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_single_pass_and_split_kv_agree(device):
    batch = _decode_batch([300, 299, 17], group=8, dtype=torch.float32, device=device, seed=7)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, 0.125)

    whole = paged_decode_attention(*args, split_size=1024)
    split = paged_decode_attention(*args, split_size=32)

    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_decode_refuses_heads_that_do_not_divide():
    q = torch.zeros(2, 6, 32)
    cache = torch.zeros(4, 16, 4, 32)
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode_attention(
            q, cache, cache, torch.ones(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 1.0
        )
    with pytest.raises(ValueError, match="split_size"):
        paged_decode_attention(
            torch.zeros(2, 8, 32),
            cache,
            cache,
            torch.ones(2, dtype=torch.int32),
            torch.zeros(2, 1, dtype=torch.int32),
            1.0,
            split_size=0,
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["-1", "num_blocks", "past the row"])
def test_a_bad_block_table_reads_nothing_outside_the_caches(device, bad):
    # given caches flanked by NaN blocks, and a table entry (or a context) that points outside them
    batch = _decode_batch([40, 20], group=2, dtype=torch.float32, device=device)
    k_cache, v_cache = poisoned_caches(batch)
    num_blocks, width = k_cache.shape[0], batch.block_tables.shape[1]
    wide = torch.full((2, width + 1), num_blocks, dtype=torch.int32, device=device)
    wide[:, :width] = batch.block_tables
    tables, seq_lens = wide[:, :width], batch.seq_lens.clone()
    if bad == "past the row":
        seq_lens[0] = width * 16 + 5  # its next entries lie in the wider tensor, naming a NaN block
    else:
        tables[1, 0] = -1 if bad == "-1" else num_blocks

    out = paged_decode_attention(batch.q, k_cache, v_cache, seq_lens, tables, 0.125)

    # then the masked keys read as zeros: the output is finite
    assert torch.isfinite(out).all()
