"""The fused CPU elementwise kernels against the plain-torch forms they replace."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_fused
from kernels.reference import ref_rms_norm, ref_rope_and_store_kv, ref_silu_mul
from tests.kernels.helpers import DTYPES, assert_close

pytestmark = [
    pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler on this machine"),
    pytest.mark.usefixtures("cpu_kernel_build"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("dim", [576, 1000])
def test_rms_norm_matches_the_torch_form(dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    weight = torch.rand(dim, generator=gen).to(dtype) + 0.5

    out = cpu_fused.rms_norm(x.clone(), weight, 1e-5)

    assert out.dtype == dtype
    assert_close(out, ref_rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_a_delta_updates_the_residual_stream_first(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 576, generator=gen).to(dtype)
    delta = torch.randn(33, 576, generator=gen).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype) + 0.5
    stream = x.clone()

    out = cpu_fused.rms_norm(stream, weight, 1e-6, residual_delta=delta)

    assert torch.equal(stream, x + delta)  # the stream itself is updated in place
    assert_close(out, ref_rms_norm(x + delta, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16385, 20000, 32768, 40000])
def test_rms_norm_of_rows_wider_than_the_scratch_matches_the_torch_form(dtype, dim):
    # bfloat16 rows pass through per-thread float32 scratch of cpu_fused.MAX_ROW floats; wider
    # ones once overran it on the stack.
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(3, dim, generator=gen) * 3).to(dtype)
    delta = torch.randn(3, dim, generator=gen).to(dtype)
    weight = torch.rand(dim, generator=gen).to(dtype) + 0.5
    stream = x.clone()

    plain = cpu_fused.rms_norm(x.clone(), weight, 1e-5)
    updated = cpu_fused.rms_norm(stream, weight, 1e-5, residual_delta=delta)

    assert_close(plain, ref_rms_norm(x, weight, 1e-5), dtype)
    assert torch.equal(stream, x + delta)
    assert_close(updated, ref_rms_norm(x + delta, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_rows_wider_than_the_scratch_matches_the_torch_form(dtype):
    width = 2 * cpu_fused.MAX_ROW + 3
    gate_up = (torch.randn(2, 2 * width, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)

    assert_close(cpu_fused.silu_mul(gate_up), ref_silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64, 257])
def test_silu_mul_matches_the_torch_form(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    # Gate values far into both tails, where a poor exp would saturate wrongly.
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 12).to(dtype)

    out = cpu_fused.silu_mul(gate_up)

    assert out.shape == (rows, 1536)
    assert_close(out, ref_silu_mul(gate_up), dtype)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_fused.rms_norm(torch.randn(4, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_fused.silu_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_fused.silu_mul(torch.randn(4, 8).half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_and_store_kv_equals_the_eager_rotation_and_store_bit_for_bit(
    dtype, num_heads, num_kv_heads, head_dim
):
    from engine.attention.torch_backend import store_kv
    from engine.models.llama import apply_rope_signed

    gen = torch.Generator().manual_seed(head_dim)
    tokens, q_size, kv_size = 37, num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(dtype)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    caches = [torch.zeros(8, 16, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]

    # the eager form: rotate q and k together, then store k and v
    qk = apply_rope_signed(qkv[:, : q_size + kv_size].reshape(tokens, -1, head_dim), cos, sin)
    expected_q = qk[:, :num_heads]
    store_kv(
        qk[:, num_heads:],
        qkv[:, q_size + kv_size :].reshape(tokens, -1, head_dim),
        caches[0],
        caches[1],
        slots,
    )

    fused = qkv.clone()
    cpu_fused.rope_and_store_kv(fused, cos, sin, slots, caches[2], caches[3], num_heads)

    assert torch.equal(fused[:, :q_size].view(tokens, num_heads, head_dim), expected_q)
    assert torch.equal(caches[2], caches[0])
    assert torch.equal(caches[3], caches[1])

    # and the slow reference, token by token and head by head, agrees
    reference = qkv.clone()
    ref_caches = [torch.zeros_like(caches[0]) for _ in range(2)]
    ref_rope_and_store_kv(reference, cos, sin, slots, *ref_caches, num_heads)
    assert torch.equal(fused, reference)
    assert torch.equal(ref_caches[0], caches[2]) and torch.equal(ref_caches[1], caches[3])


@pytest.mark.parametrize("bad_slot", [-1, 8 * 16, 2**40])
def test_rope_and_store_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(bad_slot):
    num_heads, num_kv_heads, head_dim, tokens = 4, 2, 32, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    cos, sin = torch.ones(tokens, head_dim), torch.zeros(tokens, head_dim)
    slots = torch.tensor([0, 3, bad_slot, 7, 9])
    k_cache, v_cache = torch.zeros(8, 16, num_kv_heads, head_dim), torch.zeros(8, 16, num_kv_heads, head_dim)
    before = qkv.clone()

    with pytest.raises(IndexError, match="slot"):
        cpu_fused.rope_and_store_kv(qkv, cos, sin, slots, k_cache, v_cache, num_heads)

    assert torch.equal(qkv, before)
    assert not k_cache.any() and not v_cache.any()
