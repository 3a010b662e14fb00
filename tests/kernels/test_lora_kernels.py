from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import lora_expand
from kernels.lora_groups import lora_token_groups
from kernels.lora_shrink import lora_shrink
from kernels.reference import ref_lora_expand, ref_lora_shrink
from tests.kernels.helpers import DEVICES, DTYPES, assert_close

NUM_SLOTS, HIDDEN, OUT_DIM = 3, 96, 80  # 96 and 80: not powers of two, so the last K/N tiles are partial


def _weights(dtype, device, *, rank, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lora_a = (torch.randn(NUM_SLOTS, rank, HIDDEN, generator=gen) * 0.1).to(dtype=dtype, device=device)
    lora_b = (torch.randn(NUM_SLOTS, OUT_DIM, rank, generator=gen) * 0.1).to(dtype=dtype, device=device)
    return lora_a, lora_b


def _tokens(num_tokens, dtype, device, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype=dtype, device=device)
    # slots interleaved at random, -1 (base model) among them
    slots = torch.randint(-1, NUM_SLOTS, (num_tokens,), generator=gen).to(device)
    return x, slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 15, 63, 300])
@pytest.mark.parametrize("rank", [8, 16])
def test_shrink_then_expand_match_the_reference_per_token(device, dtype, num_tokens, rank):
    lora_a, lora_b = _weights(dtype, device, rank=rank, seed=rank)
    x, slots = _tokens(num_tokens, dtype, device, seed=num_tokens)
    y = torch.randn(num_tokens, OUT_DIM).to(dtype=dtype, device=device)
    y_before = y.clone()

    s = lora_shrink(x, lora_a, slots, 0.5)
    lora_expand(y, s, lora_b, slots)

    expected_s = ref_lora_shrink(x, lora_a, slots, 0.5)
    assert s.shape == (num_tokens, rank) and s.dtype == torch.float32
    assert_close(s, expected_s, dtype)
    assert_close(y, ref_lora_expand(y_before.clone(), expected_s, lora_b, slots), dtype)
    base = slots < 0
    assert torch.equal(y[base], y_before[base])
    assert torch.equal(s[base], torch.zeros_like(s[base]))


@pytest.mark.parametrize("device", DEVICES)
def test_per_slot_scales_apply_to_each_adapters_tokens(device):
    lora_a, _ = _weights(torch.float32, device, rank=8)
    x, slots = _tokens(63, torch.float32, device, seed=1)
    scales = torch.tensor([0.25, 2.0, -1.0], device=device)

    s = lora_shrink(x, lora_a, slots, scales)

    assert_close(s, ref_lora_shrink(x, lora_a, slots, scales), torch.float32)
    unscaled = lora_shrink(x, lora_a, slots, 1.0)
    for slot, factor in enumerate(scales.tolist()):
        rows = slots == slot
        assert_close(s[rows], unscaled[rows] * factor, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_without_adapters_is_left_alone(device):
    lora_a, lora_b = _weights(torch.bfloat16, device, rank=8)
    x, _ = _tokens(15, torch.bfloat16, device)
    slots = torch.full((15,), -1, device=device)
    y = torch.randn(15, OUT_DIM).to(dtype=torch.bfloat16, device=device)
    y_before = y.clone()

    s = lora_shrink(x, lora_a, slots, 1.0)
    lora_expand(y, s, lora_b, slots)

    assert torch.equal(s, torch.zeros(15, 8, device=device))
    assert torch.equal(y, y_before)


@pytest.mark.parametrize("device", DEVICES)
def test_one_grouping_serves_shrink_and_expand_and_strided_outputs(device):
    # y a column slice of a wider output (e.g. the q part of a fused qkv projection)
    lora_a, lora_b = _weights(torch.float32, device, rank=16)
    x, slots = _tokens(63, torch.float32, device, seed=5)
    wide = torch.randn(63, OUT_DIM + 32).to(device)
    y = wide[:, :OUT_DIM]
    expected = ref_lora_expand(y.clone(), ref_lora_shrink(x, lora_a, slots, 1.0), lora_b, slots)
    tail_before = wide[:, OUT_DIM:].clone()
    groups = lora_token_groups(slots, NUM_SLOTS)

    lora_expand(y, lora_shrink(x, lora_a, slots, 1.0, groups=groups), lora_b, slots, groups=groups)

    assert_close(wide[:, :OUT_DIM], expected, torch.float32)
    assert torch.equal(wide[:, OUT_DIM:], tail_before)


def test_token_groups_list_each_slots_rows_contiguously():
    slots = torch.tensor([2, -1, 0, 2, 0, -1, 2])

    groups = lora_token_groups(slots, 4)

    assert groups.num_tokens_per_slot.tolist() == [2, 0, 3, 0]
    assert groups.slot_start.tolist() == [2, 4, 4, 7]
    assert groups.sorted_token_ids.tolist() == [1, 5, 2, 4, 0, 3, 6]


def test_lora_launchers_refuse_bad_shapes():
    lora_a = torch.zeros(2, 8, 32)
    with pytest.raises(ValueError, match="must be"):
        lora_shrink(torch.zeros(4, 16), lora_a, torch.zeros(4, dtype=torch.int64), 1.0)
    with pytest.raises(TypeError, match="share a dtype"):
        lora_shrink(torch.zeros(4, 32, dtype=torch.bfloat16), lora_a, torch.zeros(4, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="per-slot scale"):
        lora_shrink(torch.zeros(4, 32), lora_a, torch.zeros(4, dtype=torch.int64), torch.ones(3))
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand(
            torch.zeros(4, 16), torch.zeros(4, 8), torch.zeros(2, 32, 8), torch.zeros(4, dtype=torch.int64)
        )
