from __future__ import annotations

import pytest
import torch

from kernels.reference import ref_store_kvcache
from kernels.store_kvcache import store_kvcache
from tests.kernels.helpers import DEVICES, DTYPES, make_paged_batch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 15, 63, 300])
def test_store_kvcache_writes_every_token_to_its_slot_exactly(device, dtype, num_tokens):
    # given one sequence whose new tokens start mid-block, so the first and last blocks are partial
    batch = make_paged_batch(
        [num_tokens], [num_tokens + 5], num_kv_heads=2, group=1, head_dim=32, dtype=dtype, device=device
    )
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref_store_kvcache(batch.k, batch.v, expected_k, expected_v, batch.slot_mapping)

    # when
    store_kvcache(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.slot_mapping)

    # then it is a copy: bit-exact, and nothing else in the pool changed
    assert torch.equal(batch.k_cache, expected_k)
    assert torch.equal(batch.v_cache, expected_v)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_slots_leave_the_cache_untouched(device):
    batch = make_paged_batch(
        [15], [15], num_kv_heads=2, group=1, head_dim=32, dtype=torch.float32, device=device
    )
    slot_mapping = batch.slot_mapping.clone()
    slot_mapping[::2] = -1  # rows whose tokens the caller marks as not to be stored
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref_store_kvcache(batch.k, batch.v, expected_k, expected_v, slot_mapping)

    store_kvcache(batch.k, batch.v, batch.k_cache, batch.v_cache, slot_mapping)

    assert torch.equal(batch.k_cache, expected_k)
    assert torch.equal(batch.v_cache, expected_v)
    skipped = batch.slot_mapping[::2]
    flat_k = batch.k_cache.view(-1, 2, 32)
    assert not torch.equal(flat_k[skipped], batch.k[::2])


@pytest.mark.parametrize("device", DEVICES)
def test_keys_and_values_may_be_strided_views_of_a_fused_qkv(device):
    # given k and v sliced out of one (num_tokens, (8 + 2 + 2) * head_dim) projection, as the model makes them
    num_kv_heads, head_dim, num_tokens = 2, 48, 63  # head_dim 48: not a power of two, masked lanes
    batch = make_paged_batch(
        [num_tokens],
        [num_tokens],
        num_kv_heads=num_kv_heads,
        group=4,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device=device,
    )
    qkv = torch.randn(num_tokens, 12 * head_dim).to(dtype=torch.bfloat16, device=device)
    _, k, v = qkv.split([8 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    # (num_tokens, num_kv_heads, head_dim), with a row stride of 12 * head_dim
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref_store_kvcache(k, v, expected_k, expected_v, batch.slot_mapping)

    store_kvcache(k, v, batch.k_cache, batch.v_cache, batch.slot_mapping)

    assert torch.equal(batch.k_cache, expected_k)
    assert torch.equal(batch.v_cache, expected_v)


def test_mismatched_dtypes_and_shapes_are_refused():
    k = torch.zeros(4, 2, 32)
    cache = torch.zeros(8, 16, 2, 32)
    slots = torch.arange(4)
    with pytest.raises(TypeError, match="share a dtype"):
        store_kvcache(k, k, cache.bfloat16(), cache.bfloat16(), slots)
    with pytest.raises(ValueError, match="heads/head_dim"):
        store_kvcache(k, k, torch.zeros(8, 16, 4, 32), torch.zeros(8, 16, 4, 32), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(k, k, cache, cache.clone(), torch.arange(3))
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kvcache(k, k, cache, cache.clone(), slots.float())


@pytest.mark.parametrize("device", DEVICES)
def test_slots_past_the_cache_write_nothing_beyond_it(device):
    # given caches of 4 blocks that are views into larger buffers, and tokens whose slots run past them
    num_blocks, block_size = 4, 16
    k_buffer = torch.zeros(num_blocks + 2, block_size, 2, 32, device=device)
    v_buffer = torch.zeros_like(k_buffer)
    k = torch.randn(3, 2, 32, device=device)
    v = torch.randn(3, 2, 32, device=device)
    past = num_blocks * block_size
    slot_mapping = torch.tensor([5, past, past + block_size + 1], device=device)

    store_kvcache(k, v, k_buffer[:num_blocks], v_buffer[:num_blocks], slot_mapping)

    # then the in-range token is stored and the memory past the caches is untouched
    assert torch.equal(k_buffer.view(-1, 2, 32)[5], k[0])
    assert torch.equal(v_buffer.view(-1, 2, 32)[5], v[0])
    assert not k_buffer[num_blocks:].any() and not v_buffer[num_blocks:].any()
