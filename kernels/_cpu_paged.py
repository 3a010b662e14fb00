"""What the C paged attention kernels of the CPU path (decode and prefill) ask of their inputs."""

from __future__ import annotations

import torch


def supports_layout(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """CPU tensors of one element type, float32 or bfloat16, and whole GQA groups."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype
        and q.shape[1] % k_cache.shape[2] == 0
    )


def check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    """The layout both kernels read: each q row's heads contiguous (rows may be apart), contiguous
    caches that match, int32 block tables with contiguous rows. Raises ValueError otherwise."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError("q's heads must be contiguous within a row (rows may be apart)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must match")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to be contiguous and shaped like q, or a new such tensor."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be contiguous and shaped like q")
    return out
