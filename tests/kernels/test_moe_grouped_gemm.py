"""The experts' grouped GEMM against its torch reference (the block built on it:
tests/engine/test_model_families.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_grouped_gemm import moe_grouped_gemm, tile_table
from kernels.reference import ref_moe_grouped_gemm
from tests.kernels.helpers import DEVICES, DTYPES, assert_close

EXPERTS, IN, OUT = 6, 96, 80  # not powers of two: the last K and N tiles are partial


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[0, 1, 0, 0, 0, 0], [3, 0, 17, 40, 0, 1], [16, 16, 32, 0, 5, 33]])
@pytest.mark.parametrize("block_m", [None, 16])  # None: 16 or 64 rows a tile, from the counts
def test_each_experts_rows_times_its_weight(device, dtype, counts, block_m):
    gen = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), IN, generator=gen).to(dtype=dtype, device=device)
    w = (torch.randn(EXPERTS, OUT, IN, generator=gen) * 0.1).to(dtype=dtype, device=device)
    out = moe_grouped_gemm(x, w, counts, block_m=block_m)
    assert out.shape == (sum(counts), OUT) and out.dtype == dtype
    assert_close(out, ref_moe_grouped_gemm(x, w, counts), dtype)


def test_tiles_never_straddle_two_experts_and_skip_empty_ones():
    experts, starts, ends = tile_table([3, 0, 17, 16], 16, torch.device("cpu"))
    assert experts.tolist() == [0, 2, 2, 3]
    assert starts.tolist() == [0, 3, 19, 20]
    assert ends.tolist() == [3, 20, 20, 36]


def test_bad_shapes_and_counts_are_refused():
    x, w = torch.randn(4, IN), torch.randn(EXPERTS, OUT, IN)
    with pytest.raises(ValueError, match="counts must give the rows"):
        moe_grouped_gemm(x, w, [4, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="must be"):
        moe_grouped_gemm(x, w[:, :, :10], [4, 0, 0, 0, 0, 0])
    with pytest.raises(TypeError, match="share a dtype"):
        moe_grouped_gemm(x, w.to(torch.bfloat16), [4, 0, 0, 0, 0, 0])
    assert moe_grouped_gemm(x[:0], w, [0] * EXPERTS).shape == (0, OUT)
