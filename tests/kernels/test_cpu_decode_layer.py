"""The one-call decoder layer of narrow decode steps (kernels/cpu/decode_layer.c) against the layer
composed from the fused kernels' references (kernels.reference), on both builds of the kernels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels import _cpu_build, cpu_decode_layer
from kernels.cpu_decode_layer import DecodeLayers, LayerWeights
from kernels.reference import (
    ref_paged_attention,
    ref_rms_norm,
    ref_rope_and_store_kv,
    ref_silu_mul,
)

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="no C compiler for the CPU kernels")

BLOCK_SIZE, LAYERS, EPS = 16, 3, 1e-5


@dataclass(frozen=True)
class Shape:
    hidden: int = 64
    inter: int = 176
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


SHAPE = Shape()
# Widths that are no multiple of a vector (16) nor of the wide products' 4 weight rows: q|k|v has
# (3 + 2) * 18 = 90 rows, the hidden size 72 and the MLP 90 columns.
ODD = Shape(hidden=72, inter=90, heads=3, kv_heads=1, head_dim=18)
HIDDEN = SHAPE.hidden


def _layers(gen: torch.Generator, bias: bool, shape: Shape = SHAPE) -> list[LayerWeights]:
    def rand(*size: int, s: float = 0.2) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * s

    qkv_rows = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return [
        LayerWeights(
            input_norm=1 + rand(shape.hidden, s=0.1),
            post_attention_norm=1 + rand(shape.hidden, s=0.1),
            qkv=rand(qkv_rows, shape.hidden),
            qkv_bias=rand(qkv_rows) if bias else None,
            o=rand(shape.hidden, shape.heads * shape.head_dim),
            gate_up=rand(2 * shape.inter, shape.hidden),
            down=rand(shape.hidden, shape.inter),
        )
        for _ in range(LAYERS)
    ]


def _step(gen: torch.Generator, rows: int, shape: Shape = SHAPE):
    """A decode step of `rows` sequences with contexts of different lengths in shuffled blocks."""
    lens = [[1, 17, 40, 33, 5, 64, 2, 20][i % 8] + i // 8 for i in range(rows)]
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 4
    cache_shape = (blocks, BLOCK_SIZE, shape.kv_heads, shape.head_dim)
    caches = [
        (torch.randn(*cache_shape, generator=gen), torch.randn(*cache_shape, generator=gen))
        for _ in range(LAYERS)
    ]
    order = torch.randperm(blocks, generator=gen)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    slots, used = [], 0
    for i, n in enumerate(lens):
        need = -(-n // BLOCK_SIZE)
        tables[i, :need] = order[used : used + need].to(torch.int32)
        used += need
        last = n - 1
        slots.append(int(tables[i, last // BLOCK_SIZE]) * BLOCK_SIZE + last % BLOCK_SIZE)
    d = shape.head_dim
    positions = torch.tensor([n - 1 for n in lens])
    angles = positions[:, None].float() * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    sin_signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], dim=-1).contiguous()
    x = torch.randn(rows, shape.hidden, generator=gen)
    return (
        x,
        cos.contiguous(),
        sin_signed,
        caches,
        torch.tensor(slots),
        tables,
        torch.tensor(lens, dtype=torch.int32),
    )


def _reference(layers, x, cos, sin_signed, caches, slots, tables, lens, shape: Shape = SHAPE):
    delta = None
    starts = torch.arange(x.shape[0] + 1, dtype=torch.int32)
    q_size = shape.heads * shape.head_dim
    for w, (k, v) in zip(layers, caches, strict=True):
        h = ref_rms_norm(x, w.input_norm, EPS, delta)
        qkv = h @ w.qkv.T + (w.qkv_bias if w.qkv_bias is not None else 0)
        ref_rope_and_store_kv(qkv, cos, sin_signed, slots, k, v, shape.heads)
        q = qkv[:, :q_size].reshape(-1, shape.heads, shape.head_dim)
        att = ref_paged_attention(q, k, v, starts, lens, tables, shape.scale).reshape(-1, q_size)
        h = ref_rms_norm(x, w.post_attention_norm, EPS, att @ w.o.T)
        delta = ref_silu_mul(h @ w.gate_up.T) @ w.down.T
    return delta


def _decode_layers(layers: list[LayerWeights], shape: Shape = SHAPE) -> DecodeLayers:
    return DecodeLayers(
        layers,
        eps=EPS,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        scale=shape.scale,
    )


def _check_against_the_references(rows: int, bias: bool, shape: Shape) -> None:
    gen = torch.Generator().manual_seed(rows + 10 * bias + shape.hidden)
    layers = _layers(gen, bias, shape)
    x, cos, sin_signed, caches, slots, tables, lens = _step(gen, rows, shape)
    ref_x, ref_caches = x.clone(), [(k.clone(), v.clone()) for k, v in caches]
    want = _reference(layers, ref_x, cos, sin_signed, ref_caches, slots, tables, lens, shape)

    fast = _decode_layers(layers, shape)
    got = fast.forward(x, cos, sin_signed, caches, slots, tables, lens)

    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x, ref_x, rtol=1e-4, atol=1e-4)  # the residual stream, updated in place
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):  # the new tokens' K/V stored
        torch.testing.assert_close(k, rk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-5)


# Up to 8 rows each weight row streams once for every x row (with AVX2: blocks of 8 down to 1 weight
# rows by the x rows; the odd shape's widths leave a vector's tail and weight rows past the blocks).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [SHAPE, ODD], ids=["even", "odd"])
def test_one_call_layers_compute_the_layer_of_the_references(cpu_kernel_build, rows, bias, shape):
    _check_against_the_references(rows, bias, shape)


# Past 8 rows the products are register tiles of 6 x rows by 4 weight rows (AVX-512; with AVX2, up to
# 16 rows, groups of 4 x rows by 2 weight rows): whole tiles, tiles with rows left over, and widths
# with a vector's tail and weight rows past the last whole tile.
@pytest.mark.parametrize("rows", [9, 12, 13, 15, 16, 17, 24, 40, 64])
@pytest.mark.parametrize("shape", [SHAPE, ODD], ids=["even", "odd"])
def test_wide_steps_compute_the_layer_of_the_references(cpu_kernel_build, rows, shape):
    if rows > cpu_decode_layer.max_rows():
        with pytest.raises(ValueError, match="x must be"):
            _check_against_the_references(rows, True, shape)
        return
    _check_against_the_references(rows, True, shape)


def test_the_widest_step_is_256_rows_with_avx512_16_with_avx2_and_8_without(cpu_kernel_build):
    flags = set(Path("/proc/cpuinfo").read_text().split())
    avx512 = "avx512f" in flags and not _cpu_build.portable()
    avx2 = {"avx2", "fma"} <= flags
    assert cpu_decode_layer.max_rows() == (256 if avx512 else 16 if avx2 else 8)


def test_out_of_bounds_slots_and_tables_are_refused_before_anything_is_written(cpu_kernel_build):
    gen = torch.Generator().manual_seed(7)
    layers = _layers(gen, bias=False)
    fast = _decode_layers(layers)
    x, cos, sin_signed, caches, slots, tables, lens = _step(gen, 2)
    before_x, before = x.clone(), [(k.clone(), v.clone()) for k, v in caches]

    bad_slots = slots.clone()
    bad_slots[1] = caches[0][0].shape[0] * BLOCK_SIZE
    with pytest.raises(IndexError, match="slot"):
        fast.forward(x, cos, sin_signed, caches, bad_slots, tables, lens)
    bad_tables = tables.clone()
    bad_tables[1, 0] = caches[0][0].shape[0]
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
    wide = torch.randn(fast.max_rows + 1, HIDDEN)
    with pytest.raises(ValueError, match="x must be"):
        fast.forward(wide, cos, sin_signed, caches, slots, tables, lens)
    with pytest.raises(ValueError, match="KV caches"):
        fast.forward(x, cos, sin_signed, caches[:-1], slots, tables, lens)
    transposed = LayerWeights(
        **{**{f: getattr(layers[0], f) for f in LayerWeights.__slots__}, "o": layers[0].o.t()}
    )
    with pytest.raises(ValueError, match="layer 0 o"):
        _decode_layers([transposed])


def _as_dtype(layers: list[LayerWeights], dtype: torch.dtype) -> list[LayerWeights]:
    return [
        LayerWeights(
            **{
                f: None if getattr(layer, f) is None else getattr(layer, f).to(dtype)
                for f in LayerWeights.__slots__
            }
        )
        for layer in layers
    ]


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.float() - exact).norm() / exact.norm())


# bfloat16, with AVX512-BF16's dot products: each product's output rounded once from its float32
# sum, the norms, the rotary embedding and silu rounded where the engine's layer path rounds them.
# The order of a product's sums differs from the reference's, so the kernel and the reference
# composed in bfloat16 are each measured against the float32 reference of the same bfloat16 inputs:
# the kernel may be no farther from it than the bfloat16 reference (the residual stream, the
# output and the K/V stored).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 13, 40])
@pytest.mark.parametrize("shape", [SHAPE, ODD], ids=["even", "odd"])
def test_bfloat16_layers_are_as_close_to_float32_as_the_bfloat16_reference(cpu_kernel_build, rows, shape):
    if cpu_decode_layer.max_rows(torch.bfloat16) == 0:
        pytest.skip("this build has no bfloat16 dot products (AVX512-BF16)")
    gen = torch.Generator().manual_seed(100 + rows + shape.hidden)
    layers = _as_dtype(_layers(gen, True, shape), torch.bfloat16)
    x, cos, sin_signed, caches, slots, tables, lens = _step(gen, rows, shape)
    x, cos, sin_signed = x.bfloat16(), cos.bfloat16(), sin_signed.bfloat16()
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in caches]

    exact_x, exact_caches = x.float(), [(k.float(), v.float()) for k, v in caches]
    exact = _reference(
        _as_dtype(layers, torch.float32), exact_x, cos.float(), sin_signed.float(), exact_caches,
        slots, tables, lens, shape,
    )  # fmt: skip
    ref_x, ref_caches = x.clone(), [(k.clone(), v.clone()) for k, v in caches]
    ref = _reference(layers, ref_x, cos, sin_signed, ref_caches, slots, tables, lens, shape)

    fast = _decode_layers(layers, shape)
    if rows > fast.max_rows:  # with AMX, wider steps keep the layer path
        with pytest.raises(ValueError, match="x must be"):
            fast.forward(x, cos, sin_signed, caches, slots, tables, lens)
        return
    got = fast.forward(x, cos, sin_signed, caches, slots, tables, lens)

    assert got.dtype == torch.bfloat16
    pairs = [(got, ref, exact), (x, ref_x, exact_x)]
    for (k, v), (rk, rv), (ek, ev) in zip(caches, ref_caches, exact_caches, strict=True):
        pairs += [(k[slots // BLOCK_SIZE, slots % BLOCK_SIZE], rk[slots // BLOCK_SIZE, slots % BLOCK_SIZE],
                   ek[slots // BLOCK_SIZE, slots % BLOCK_SIZE])]  # fmt: skip
        pairs += [(v[slots // BLOCK_SIZE, slots % BLOCK_SIZE], rv[slots // BLOCK_SIZE, slots % BLOCK_SIZE],
                   ev[slots // BLOCK_SIZE, slots % BLOCK_SIZE])]  # fmt: skip
    for fast, reference, want in pairs:
        assert _relative_error(fast, want) <= 1.25 * _relative_error(reference, want) + 2e-3


def test_bfloat16_steps_are_taken_where_the_cpu_has_bfloat16_dot_products(cpu_kernel_build):
    flags = set(Path("/proc/cpuinfo").read_text().split())
    native = "avx512_bf16" in flags and not _cpu_build.portable()
    widest = cpu_decode_layer.AMX_BF16_MAX_ROWS if "amx_tile" in flags else 256
    assert cpu_decode_layer.max_rows(torch.bfloat16) == (widest if native else 0)
    gen = torch.Generator().manual_seed(5)
    layers = _as_dtype(_layers(gen, bias=False), torch.bfloat16)
    if not native:
        with pytest.raises(ValueError, match="takes no torch.bfloat16 steps"):
            _decode_layers(layers)
        return
    fast = _decode_layers(layers)
    x, cos, sin_signed, caches, slots, tables, lens = _step(gen, 2)
    with pytest.raises(ValueError, match="contiguous torch.bfloat16"):  # float32 inputs to bfloat16 layers
        fast.forward(x, cos.bfloat16(), sin_signed.bfloat16(), caches, slots, tables, lens)
    mixed = LayerWeights(
        **{**{f: getattr(layers[0], f) for f in LayerWeights.__slots__}, "o": layers[0].o.float()}
    )
    with pytest.raises(ValueError, match="layer 0 o"):
        _decode_layers([mixed])
