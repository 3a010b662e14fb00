"""The GPU's fused elementwise kernels (kernels.gpu_fused) against the torch forms they replace in
engine.models.llama: in float32 to rounding noise, in bfloat16 within one rounding of the dtype; the
residual update in place exactly; the K/V store skipping the slots it must skip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.llama import apply_rope_signed
from kernels import gpu_fused
from kernels.reference import ref_store_kvcache
from tests.kernels.helpers import DEVICES, DTYPES


def _close(dtype: torch.dtype, device: str) -> dict[str, float]:
    """float32: rounding noise. bfloat16: one rounding (a unit in the last place, up to 2**-7
    relative) on a GPU; two under Triton's interpreter, whose float32 to bfloat16 conversion does
    not round to nearest even."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 1e-2, "rtol": 2**-7 if device == "cuda" else 2**-6}


def _assert_rounded_alike(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit for bit on a GPU. Triton's interpreter rounds float32 to bfloat16 its own way (not to
    nearest even), so on CPU a bfloat16 result may be one unit in the last place away."""
    if actual.device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, atol=0, rtol=2**-6)


def _torch_rms_norm(x, weight, eps, delta):
    if delta is not None:
        x.add_(delta)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim", "with_delta"), [(1, 64, False), (7, 576, True), (3, 1000, True)])
def test_rms_norm_matches_the_torch_form_and_updates_the_residual_in_place(
    device, dtype, rows, dim, with_delta
):
    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device, dtype)
    delta = torch.randn(rows, dim, generator=gen).to(device, dtype) if with_delta else None
    x_ref = x.clone()
    expected = _torch_rms_norm(x_ref, weight, 1e-5, delta)
    out = gpu_fused.rms_norm(x, weight, 1e-5, delta)
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), **_close(dtype, device))
    _assert_rounded_alike(x, x_ref, dtype)  # the residual stream x += delta, as add_ rounds it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 48), (5, 1536), (2, 1100)])
def test_silu_mul_matches_the_torch_form(device, dtype, rows, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=gen)).to(device, dtype)
    gate, up = gate_up.clone().split(width, dim=-1)
    expected = F.silu(gate).mul(up)
    out = gpu_fused.silu_mul(gate_up)
    assert out.shape == (rows, width)
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), **_close(dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 80)])
def test_rope_and_store_kv_rotates_q_and_k_and_stores_k_and_v(
    device, dtype, num_heads, num_kv_heads, head_dim
):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, block_size, num_blocks = 6, 4, 5
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(device, dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(device, dtype)
    # Token 2 has nothing to store (a negative slot); token 4's slot lies past the cache.
    slots = torch.tensor([0, 5, -1, 19, 20, 7], device=device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (
        torch.zeros(shape, device=device, dtype=dtype),
        torch.zeros(shape, device=device, dtype=dtype),
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    heads = qkv.clone().view(tokens, -1, head_dim)
    rotated = apply_rope_signed(heads[:, : num_heads + num_kv_heads], cos, sin)
    expected = torch.cat([rotated, heads[:, num_heads + num_kv_heads :]], dim=1)
    keep = slots.ge(0) & slots.lt(num_blocks * block_size)
    ref_store_kvcache(
        expected[keep, num_heads : num_heads + num_kv_heads],
        expected[keep, num_heads + num_kv_heads :],
        k_ref,
        v_ref,
        slots[keep],
    )

    gpu_fused.rope_and_store_kv(qkv, cos, sin, slots, k_cache, v_cache, num_heads)
    close = _close(dtype, device)
    torch.testing.assert_close(qkv.view(tokens, -1, head_dim).float().cpu(), expected.float().cpu(), **close)
    torch.testing.assert_close(k_cache.float().cpu(), k_ref.float().cpu(), **close)
    assert torch.equal(v_cache, v_ref)  # v is copied, never rounded
