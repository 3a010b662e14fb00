"""The one-call decoder layer of narrow decode steps (kernels/cpu/decode_layer.c) against the layer
composed from the fused kernels' references (kernels.reference), on both builds of the kernels."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_layer
from kernels.cpu_decode_layer import DecodeLayers, LayerWeights
from kernels.reference import (
    ref_paged_attention,
    ref_rms_norm,
    ref_rope_and_store_kv,
    ref_silu_mul,
)

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="no C compiler for the CPU kernels")

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 64, 176, 4, 2, 16
BLOCKS, BLOCK_SIZE, LAYERS = 32, 16, 3
EPS, SCALE = 1e-5, HEAD_DIM**-0.5


def _layers(gen: torch.Generator, bias: bool) -> list[LayerWeights]:
    def rand(*shape: int, s: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * s

    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [
        LayerWeights(
            input_norm=1 + rand(HIDDEN, s=0.1),
            post_attention_norm=1 + rand(HIDDEN, s=0.1),
            qkv=rand(qkv_rows, HIDDEN),
            qkv_bias=rand(qkv_rows) if bias else None,
            o=rand(HIDDEN, HEADS * HEAD_DIM),
            gate_up=rand(2 * INTER, HIDDEN),
            down=rand(HIDDEN, INTER),
        )
        for _ in range(LAYERS)
    ]


def _step(gen: torch.Generator, rows: int):
    """A decode step of `rows` sequences with contexts of different lengths in shuffled blocks."""
    caches = [
        (torch.randn(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen),
         torch.randn(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen))
        for _ in range(LAYERS)
    ]  # fmt: skip
    lens = [1, 17, 40, 33, 5, 64, 2, 20][:rows]
    order = torch.randperm(BLOCKS, generator=gen)
    width = 4
    tables = torch.zeros(rows, width, dtype=torch.int32)
    slots, used = [], 0
    for i, n in enumerate(lens):
        need = -(-n // BLOCK_SIZE)
        tables[i, :need] = order[used : used + need].to(torch.int32)
        used += need
        last = n - 1
        slots.append(int(tables[i, last // BLOCK_SIZE]) * BLOCK_SIZE + last % BLOCK_SIZE)
    positions = torch.tensor([n - 1 for n in lens])
    angles = (
        positions[:, None].float() * (1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))[None]
    )
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    sin_signed = torch.cat([-sin[:, : HEAD_DIM // 2], sin[:, HEAD_DIM // 2 :]], dim=-1).contiguous()
    x = torch.randn(rows, HIDDEN, generator=gen)
    return (
        x,
        cos.contiguous(),
        sin_signed,
        caches,
        torch.tensor(slots),
        tables,
        torch.tensor(lens, dtype=torch.int32),
    )


def _reference(layers, x, cos, sin_signed, caches, slots, tables, lens):
    delta = None
    starts = torch.arange(x.shape[0] + 1, dtype=torch.int32)
    for w, (k, v) in zip(layers, caches, strict=True):
        h = ref_rms_norm(x, w.input_norm, EPS, delta)
        qkv = h @ w.qkv.T + (w.qkv_bias if w.qkv_bias is not None else 0)
        ref_rope_and_store_kv(qkv, cos, sin_signed, slots, k, v, HEADS)
        q = qkv[:, : HEADS * HEAD_DIM].reshape(-1, HEADS, HEAD_DIM)
        att = ref_paged_attention(q, k, v, starts, lens, tables, SCALE).reshape(-1, HEADS * HEAD_DIM)
        h = ref_rms_norm(x, w.post_attention_norm, EPS, att @ w.o.T)
        delta = ref_silu_mul(h @ w.gate_up.T) @ w.down.T
    return delta


def _decode_layers(layers: list[LayerWeights]) -> DecodeLayers:
    return DecodeLayers(
        layers, eps=EPS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=SCALE
    )


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_one_call_layers_compute_the_layer_of_the_references(cpu_kernel_build, rows, bias):
    gen = torch.Generator().manual_seed(rows + 10 * bias)
    layers = _layers(gen, bias)
    x, cos, sin_signed, caches, slots, tables, lens = _step(gen, rows)
    ref_x, ref_caches = x.clone(), [(k.clone(), v.clone()) for k, v in caches]
    want = _reference(layers, ref_x, cos, sin_signed, ref_caches, slots, tables, lens)

    fast = _decode_layers(layers)
    got = fast.forward(x, cos, sin_signed, caches, slots, tables, lens)

    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x, ref_x, rtol=1e-4, atol=1e-4)  # the residual stream, updated in place
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):  # the new tokens' K/V stored
        torch.testing.assert_close(k, rk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-5)


def test_out_of_bounds_slots_and_tables_are_refused_before_anything_is_written(cpu_kernel_build):
    gen = torch.Generator().manual_seed(7)
    layers = _layers(gen, bias=False)
    fast = _decode_layers(layers)
    x, cos, sin_signed, caches, slots, tables, lens = _step(gen, 2)
    before_x, before = x.clone(), [(k.clone(), v.clone()) for k, v in caches]

    bad_slots = slots.clone()
    bad_slots[1] = BLOCKS * BLOCK_SIZE
    with pytest.raises(IndexError, match="slot"):
        fast.forward(x, cos, sin_signed, caches, bad_slots, tables, lens)
    bad_tables = tables.clone()
    bad_tables[1, 0] = BLOCKS
    with pytest.raises(IndexError, match="block table"):
        fast.forward(x, cos, sin_signed, caches, slots, bad_tables, lens)
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * BLOCK_SIZE + 1
    with pytest.raises(ValueError, match="context length"):
        fast.forward(x, cos, sin_signed, caches, slots, tables, too_long)

    assert torch.equal(x, before_x)
    for (k, v), (bk, bv) in zip(caches, before, strict=True):
        assert torch.equal(k, bk) and torch.equal(v, bv)


def test_wider_steps_and_wrong_weights_are_refused(cpu_kernel_build):
    gen = torch.Generator().manual_seed(3)
    layers = _layers(gen, bias=False)
    fast = _decode_layers(layers)
    x, cos, sin_signed, caches, slots, tables, lens = _step(gen, 4)
    wide = torch.randn(cpu_decode_layer.MAX_ROWS + 1, HIDDEN)
    with pytest.raises(ValueError, match="x must be"):
        fast.forward(wide, cos, sin_signed, caches, slots, tables, lens)
    with pytest.raises(ValueError, match="KV caches"):
        fast.forward(x, cos, sin_signed, caches[:-1], slots, tables, lens)
    transposed = LayerWeights(
        **{**{f: getattr(layers[0], f) for f in LayerWeights.__slots__}, "o": layers[0].o.t()}
    )
    with pytest.raises(ValueError, match="layer 0 o"):
        _decode_layers([transposed])
