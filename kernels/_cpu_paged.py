"""What the C paged attention kernels of the CPU path (decode and prefill) ask of their inputs."""

from __future__ import annotations

import ctypes

import torch

# The arguments both kernels begin with (kernels/cpu/paged_*_attention.c), then those they end with.
LEADING_ARGS = [
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q_stride
    ctypes.c_void_p,  # k_cache
    ctypes.c_void_p,  # v_cache
    ctypes.c_int,  # is_bf16
    ctypes.c_int64,  # num_blocks
    ctypes.c_void_p,  # block_tables
    ctypes.c_int64,  # bt_stride
]
TRAILING_ARGS = [
    ctypes.c_int,  # num_heads
    ctypes.c_int,  # num_kv_heads
    ctypes.c_int,  # head_dim
    ctypes.c_int,  # block_size
    ctypes.c_float,  # scale
    ctypes.c_void_p,  # out
    ctypes.c_int,  # num_threads
]


def heads_contiguous(q: torch.Tensor) -> torch.Tensor:
    """q itself when each row's heads are contiguous (rows may be apart, as in a fused projection's
    output), else a contiguous copy: the layout the kernels read."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


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
    caches that match q's head size, int32 block tables with contiguous rows. Raises ValueError
    otherwise."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            "q must be (rows, heads, head_dim) and the caches (blocks, block_size, kv_heads, head_dim)"
        )
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError("q's heads must be contiguous within a row (rows may be apart)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must match")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to be contiguous and shaped like q, or a new such tensor."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be contiguous and shaped like q")
    return out


def raise_for_status(status: int, op: str, buffers: str) -> None:
    """The kernels' return codes (kernels/cpu/paged_bounds.h) as exceptions; 0 raises nothing. On
    any other code the kernel has read and written nothing."""
    if status == 0:
        return
    if status == 2:
        raise MemoryError(f"{op}: out of memory for the {buffers}")
    if status == 3:
        raise IndexError(f"{op}: a block table entry lies outside the KV cache's blocks")
    if status == 4:
        raise ValueError(f"{op}: a context length is negative or longer than its block table row covers")
    if status == 5:
        raise IndexError(f"{op}: a query row or block table row lies outside its tensor")
    raise ValueError(f"{op}: sizes beyond the kernel's limits")
