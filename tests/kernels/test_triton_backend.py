from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from kernels.reference import ref_paged_attention, ref_store_kvcache
from tests.kernels.helpers import DEVICES, DTYPES, PagedBatch, assert_close, make_paged_batch


def _expected(batch: PagedBatch, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    ref_store_kvcache(batch.k, batch.v, k_cache, v_cache, batch.slot_mapping)
    out = ref_paged_attention(
        batch.q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    return out, k_cache, v_cache


def _run(backend: AttentionBackend, batch: PagedBatch, scale: float) -> torch.Tensor:
    return backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata(), scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_step_stores_the_new_kv_then_attends_over_the_cache(device, dtype):
    # given decodes beside a fresh prompt and a chunk following cached tokens
    batch = make_paged_batch(
        [1, 15, 63, 1], [300, 15, 83, 1], num_kv_heads=2, group=4, head_dim=32, dtype=dtype, device=device
    )
    expected, expected_k_cache, expected_v_cache = _expected(batch, 0.2)

    out = _run(TritonAttentionBackend(), batch, 0.2)

    assert torch.equal(batch.k_cache, expected_k_cache)
    assert torch.equal(batch.v_cache, expected_v_cache)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 8])
def test_a_decode_only_step_takes_the_split_kv_path(device, group):
    batch = make_paged_batch(
        [1, 1, 1], [300, 1, 63], num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32, device=device
    )
    expected, expected_k_cache, _ = _expected(batch, 0.2)

    out = _run(TritonAttentionBackend(decode_split_size=32), batch, 0.2)

    assert torch.equal(batch.k_cache, expected_k_cache)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("query_lens", "seq_lens"), [([1, 1], [63, 300]), ([15, 1, 40], [15, 300, 70])])
def test_the_triton_and_torch_backends_agree(device, query_lens, seq_lens):
    batch = make_paged_batch(
        query_lens, seq_lens, num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32, device=device
    )
    twin = make_paged_batch(
        query_lens, seq_lens, num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32, device=device
    )

    triton_out = _run(TritonAttentionBackend(decode_split_size=64), batch, 0.125)
    torch_out = _run(TorchAttentionBackend(), twin, 0.125)

    assert torch.equal(batch.k_cache, twin.k_cache)
    assert_close(triton_out, torch_out, torch.float32)


def test_a_non_positive_split_size_is_refused():
    with pytest.raises(ValueError, match="decode_split_size"):
        TritonAttentionBackend(decode_split_size=0)
