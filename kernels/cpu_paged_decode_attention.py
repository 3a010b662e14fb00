"""Paged decode attention on the CPU, in C, read in place from the paged KV cache.

PagedAttention (Kwon et al., SOSP 2023), as vLLM's CPU backend runs it: the plain-torch path gathers
every decode's context into a padded batch per layer (tens of megabytes copied per layer and step)
before attending; this kernel reads each K and V row where it lies, once, for the whole GQA group.
The source (kernels/cpu/paged_decode_attention.c) is compiled on first use (kernels._cpu_build) and
called through ctypes; its threads are those of torch's OpenMP runtime. Where it cannot be built
(no compiler, or PAGODA_CPU_KERNELS=0) `available()` is False and the torch path runs instead.

The kernel checks what the caller hands it before reading anything: a block table entry a context
reads outside the pool, a context longer than its table row covers, or a row outside q raises
(IndexError or ValueError) instead of reading or writing out of bounds.

Reference: kernels.reference.ref_paged_attention (each query a decode row).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import _cpu_build, _cpu_paged

_SIGNATURES = {
    "paged_decode_attention": (
        ctypes.c_int,
        [
            *_cpu_paged.LEADING_ARGS,
            ctypes.c_int64,  # bt_width
            ctypes.c_void_p,  # seq_lens
            ctypes.c_void_p,  # rows (nullable)
            ctypes.c_int64,  # num_rows (of q and out)
            ctypes.c_int,  # num_seqs
            ctypes.c_void_p,  # starts (nullable)
            ctypes.c_float,  # softcap (0: none)
            *_cpu_paged.TRAILING_ARGS,
        ],
    )
}


def _load() -> ctypes.CDLL | None:
    return _cpu_build.load("paged_decode_attention", _SIGNATURES)


def available() -> bool:
    """True when the kernel is compiled and loaded (compiling it on the first call)."""
    return _load() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel handles these shapes and dtypes (the torch path handles the rest)."""
    return _cpu_paged.supports_layout(q, k_cache)


def paged_decode_attention_cpu(
    q: torch.Tensor,  # (num_rows, num_heads, head_dim), each row contiguous
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, entries in [0, num_blocks)
    seq_lens: torch.Tensor,  # (num_seqs,) int32: context length including the query's own token
    scale: float,
    *,
    rows: torch.Tensor | None = None,  # (num_seqs,) int64: sequence i's row of q and out
    out: torch.Tensor | None = None,  # (num_rows, num_heads, head_dim), written in the given rows
    starts: torch.Tensor | None = None,  # (num_seqs,) int32: each sequence's first key (a window's)
    softcap: float | None = None,  # scores soft-capped as softcap * tanh(score / softcap)
) -> torch.Tensor:
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU decode attention kernel is not available")
    if not supports(q, k_cache):
        raise ValueError(f"unsupported decode attention: q {tuple(q.shape)} {q.dtype}, cache {k_cache.dtype}")
    _cpu_paged.check_inputs(q, k_cache, v_cache, block_tables)
    num_seqs = seq_lens.shape[0]
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError("block_tables and seq_lens disagree on the number of sequences")
    if rows is None:
        if q.shape[0] != num_seqs:
            raise ValueError("without rows, q must have one row per sequence")
    else:
        rows = rows.to(torch.int64).contiguous()
        if rows.shape[0] != num_seqs:
            raise ValueError("rows must name one row per sequence")
    if starts is not None:
        starts = starts.to(torch.int32).contiguous()
        if starts.shape != (num_seqs,):
            raise ValueError("starts must give one first key per sequence")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    out = _cpu_paged.output_for(q, out)
    if num_seqs == 0:
        return out
    status = lib.paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        int(q.dtype == torch.bfloat16),
        k_cache.shape[0],
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        None if rows is None else rows.data_ptr(),
        q.shape[0],
        num_seqs,
        None if starts is None else starts.data_ptr(),
        float(softcap or 0.0),
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _cpu_paged.raise_for_status(status, "decode attention", "score buffers")
    return out
