from __future__ import annotations

import pytest
import torch

from kernels.paged_decode_attention import paged_decode_attention
from kernels.prefill_attention import prefill_attention
from tests.kernels.helpers import (
    DEVICES,
    DTYPES,
    assert_close,
    make_paged_batch,
    poisoned_caches,
    reference_attention,
)

# (query_len, seq_len) per sequence of one mixed step:
#   a one-token prompt, a fresh 15-token prompt, a 63-token chunk after 20 cached tokens (prefix hit
#   or earlier chunk), a decode row over a 300-token context, and the last 15 tokens of a 300 prompt.
MIXED = [(1, 1), (15, 15), (63, 83), (1, 300), (15, 300)]


def _batch(pairs, *, group, dtype, device, head_dim=32, seed=0):
    query_lens, seq_lens = zip(*pairs, strict=True)
    return make_paged_batch(
        list(query_lens),
        list(seq_lens),
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
    )


def _prefill(batch, scale, **kwargs):
    return prefill_attention(*batch.attention_args, scale, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_the_reference_on_a_mixed_batch(device, dtype, group):
    batch = _batch(MIXED, group=group, dtype=dtype, device=device, seed=group)
    scale = 32**-0.5

    out = _prefill(batch, scale)

    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, reference_attention(batch, scale), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(7, None), (40, None), (None, 2.5), (40, 2.5), (1, None)])
@pytest.mark.parametrize(("block_m", "block_n"), [(None, 64), (64, 16)])
def test_a_sliding_window_and_soft_capped_scores_match_the_reference(
    device, dtype, window, softcap, block_m, block_n
):
    """Gemma's layers: each query sees its last `window` positions (tiles of keys before a row's
    window, and rows that see nothing in a tile, included), its scores capped before the softmax."""
    batch = _batch(MIXED, group=4, dtype=dtype, device=device, seed=3)
    scale = 32**-0.5

    out = _prefill(batch, scale, window=window, softcap=softcap, block_m=block_m, block_n=block_n)

    assert_close(out, reference_attention(batch, scale, window=window, softcap=softcap), dtype)
    if window is not None or softcap is not None:  # the options change the answer
        assert not torch.allclose(out.float(), reference_attention(batch, scale).float(), atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_a_300_token_prompt_from_scratch_is_causal_across_many_tiles(device):
    batch = _batch([(300, 300)], group=4, dtype=torch.float32, device=device)

    out = _prefill(batch, 0.2)

    assert_close(out, reference_attention(batch, 0.2), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (16, 64), (64, 16)])
def test_tile_sizes_do_not_change_the_result(device, block_m, block_n):
    # Query tiles smaller than a chunk put the causal diagonal inside and across tiles.
    batch = _batch([(63, 83), (1, 40), (33, 33)], group=4, dtype=torch.float32, device=device, seed=3)

    out = _prefill(batch, 0.2, block_m=block_m, block_n=block_n)

    assert_close(out, reference_attention(batch, 0.2), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_prefill_handles_head_dims_that_are_not_tile_sized(device, head_dim):
    batch = _batch([(15, 40), (17, 17)], group=4, dtype=torch.bfloat16, device=device, head_dim=head_dim)
    scale = head_dim**-0.5

    out = _prefill(batch, scale)

    assert_close(out, reference_attention(batch, scale), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_rows_get_the_same_answer_from_either_kernel(device):
    batch = _batch([(1, 1), (1, 15), (1, 63), (1, 300)], group=4, dtype=torch.float32, device=device, seed=11)

    via_prefill = _prefill(batch, 0.2)
    via_decode = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, 0.2, split_size=64
    )

    torch.testing.assert_close(via_prefill, via_decode, atol=1e-5, rtol=1e-5)


def test_prefill_refuses_tiles_smaller_than_a_dot_and_mismatched_metadata():
    q = torch.zeros(4, 8, 32)
    cache = torch.zeros(4, 16, 2, 32)
    seq_lens = torch.tensor([4], dtype=torch.int32)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(
            q, cache, cache, torch.tensor([0, 4], dtype=torch.int32), seq_lens, tables, 1.0, block_m=8
        )
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention(q, cache, cache, torch.tensor([0, 2, 4], dtype=torch.int32), seq_lens, tables, 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["-1", "num_blocks", "past the row"])
def test_a_bad_block_table_reads_nothing_outside_the_caches(device, bad):
    batch = _batch([(20, 20), (30, 60)], group=2, dtype=torch.float32, device=device)
    k_cache, v_cache = poisoned_caches(batch)
    num_blocks, width = k_cache.shape[0], batch.block_tables.shape[1]
    wide = torch.full((2, width + 1), num_blocks, dtype=torch.int32, device=device)
    wide[:, :width] = batch.block_tables
    tables, seq_lens = wide[:, :width], batch.seq_lens.clone()
    if bad == "past the row":
        seq_lens[1] = width * 16 + 5
    else:
        tables[1, 1] = -1 if bad == "-1" else num_blocks

    out = prefill_attention(batch.q, k_cache, v_cache, batch.query_start_loc, seq_lens, tables, 0.125)

    assert torch.isfinite(out).all()
