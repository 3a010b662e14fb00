"""Causal attention for prompt chunks on the CPU, in C, over the paged KV cache.

A chunk's queries attend over everything its sequence has cached, its own keys and values included
(the caller stores them first), in one call for every chunk of a step: no gather of a cached
context into a contiguous batch and no mask tensors, where the torch path builds both for a chunk
that follows cached tokens. The query tiles hold every query head of a GQA group, so each key and
value serves the whole group. The source (kernels/cpu/paged_prefill_attention.c) is compiled on
first use (kernels._cpu_build) and called through ctypes; its threads are those of torch's OpenMP
runtime. Where it cannot be built (no compiler, or PAGODA_CPU_KERNELS=0) `available()` is False and
the torch path runs instead.

The kernel checks what the caller hands it before reading anything: a block table entry a context
reads outside the pool, a context longer than its table row covers, or a chunk's rows outside q or
the block tables raise (IndexError or ValueError) instead of reading or writing out of bounds.

Reference: kernels.reference.ref_paged_attention.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import torch

from kernels import _cpu_build, _cpu_paged

_SIGNATURES = {
    "paged_prefill_attention": (
        ctypes.c_int,
        [
            *_cpu_paged.LEADING_ARGS,
            ctypes.c_int64,  # bt_rows
            ctypes.c_int64,  # bt_width
            ctypes.c_void_p,  # chunk_seq
            ctypes.c_void_p,  # q_start
            ctypes.c_void_p,  # q_len
            ctypes.c_void_p,  # seq_len
            ctypes.c_int64,  # num_rows (of q and out)
            ctypes.c_int,  # num_chunks
            *_cpu_paged.TRAILING_ARGS,
        ],
    )
}

# Query rows per tile at most (the kernel's MAX_RV * VL): a GQA group must fit in one.
_MAX_ROWS = 48
_MAX_HEAD_DIM = 256


def _load() -> ctypes.CDLL | None:
    return _cpu_build.load("paged_prefill_attention", _SIGNATURES)


@functools.cache
def has_vector_tiles() -> bool:
    """Whether the kernel as built here has its AVX-512 tiles: an x86 CPU with AVX-512F, and not a
    portable build (PAGODA_CPU_PORTABLE=1). Without them it computes one query row at a time."""
    if platform.machine().lower() not in ("x86_64", "amd64") or _cpu_build.portable():
        return False
    return "avx512f" in _cpu_build.cpu_flags()


def available() -> bool:
    """True when the kernel is compiled and loaded (compiling it on the first call)."""
    return _load() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel handles these shapes and dtypes (the torch path handles the rest)."""
    return (
        _cpu_paged.supports_layout(q, k_cache)
        and q.shape[1] // k_cache.shape[2] <= _MAX_ROWS
        and q.shape[2] % 8 == 0
        and q.shape[2] <= _MAX_HEAD_DIM
    )


class ChunkTable:
    """The prompt chunks of a step, as the kernel reads them: for chunk c, sequence ``seqs[c]``
    (its row of the block tables), query rows ``starts[c]`` onwards, ``query_lens[c]`` of them, and
    a context of ``seq_lens[c]`` tokens, the chunk's own last."""

    __slots__ = ("seqs", "starts", "query_lens", "seq_lens", "num_seqs_needed", "num_rows_needed")

    def __init__(
        self, seqs: list[int], starts: list[int], query_lens: list[int], seq_lens: list[int]
    ) -> None:
        if not (len(seqs) == len(starts) == len(query_lens) == len(seq_lens)):
            raise ValueError("chunk lists of different lengths")
        if any(not 1 <= q <= n for q, n in zip(query_lens, seq_lens, strict=True)):
            raise ValueError("each chunk needs 1 <= query_len <= seq_len")
        if any(s < 0 for s in seqs) or any(s < 0 for s in starts):
            raise ValueError("a chunk names a negative sequence or query row")
        self.seqs = torch.tensor(seqs, dtype=torch.int32)
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.query_lens = torch.tensor(query_lens, dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        # The block-table rows and query rows a call must have, checked on every layer's call.
        self.num_seqs_needed = max(seqs, default=-1) + 1
        self.num_rows_needed = max((s + q for s, q in zip(starts, query_lens, strict=True)), default=0)

    def __len__(self) -> int:
        return self.seqs.shape[0]


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # (num_rows, num_heads, head_dim), each row's heads contiguous
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    chunks: ChunkTable,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # (num_rows, num_heads, head_dim), written in the chunks' rows
) -> torch.Tensor:
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU prefill attention kernel is not available")
    if not supports(q, k_cache):
        raise ValueError(
            f"unsupported prefill attention: q {tuple(q.shape)} {q.dtype}, cache {k_cache.dtype}"
        )
    _cpu_paged.check_inputs(q, k_cache, v_cache, block_tables)
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    out = _cpu_paged.output_for(q, out)
    if len(chunks) == 0:
        return out
    if chunks.num_seqs_needed > block_tables.shape[0]:
        raise ValueError("a chunk names a sequence beyond the block tables")
    if chunks.num_rows_needed > q.shape[0]:
        raise ValueError("a chunk's query rows run past q")
    status = lib.paged_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        int(q.dtype == torch.bfloat16),
        k_cache.shape[0],
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[0],
        block_tables.shape[1],
        chunks.seqs.data_ptr(),
        chunks.starts.data_ptr(),
        chunks.query_lens.data_ptr(),
        chunks.seq_lens.data_ptr(),
        q.shape[0],
        len(chunks),
        q.shape[1],
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _cpu_paged.raise_for_status(status, "prefill attention", "tile buffers")
    return out
