"""Paged attention in plain torch: the CPU backend and the reference the Triton backend is tested against.

The layout work of a step (which rows decode, their padded block lists, the masks) depends only on
the metadata; on CPU it is planned once per step and reused by every layer (off CPU each layer plans
it again, see TorchAttentionBackend); a layer itself only stores its K/V, gathers and attends.

- Decode rows (one new token each: every row of a decode-only step, or the decodes of a mixed one)
  attend in a few groups of similar context length: each group's contexts are gathered block by
  block into one padded batch and a single scaled_dot_product_attention runs with an additive
  padding mask. The grouped query heads of each KV head ride along as extra query rows, so GQA
  costs no K/V repeat.
- A fresh prompt chunk (nothing cached before it) attends causally over its own K/V, which are never
  read back from the cache.
- A chunk that follows cached tokens gathers its context and uses a causal mask offset by them.

On CPU the decode rows go to a C kernel that reads the paged cache in place
(kernels.cpu_paged_decode_attention) when it could be compiled, and so do the prompt chunks, fresh
or following cached tokens (kernels.cpu_paged_prefill_attention: no gather, no masks, about twice
torch's flash attention on short chunks); otherwise, and off CPU, they take the paths above, whose
gathers land in workspaces kept across steps on CPU: a fresh tensor of tens of megabytes per layer
costs more in page faults than the copy itself. One exception: in bfloat16 on a CPU with AMX,
torch's flash attention multiplies on the AMX tiles while the C kernel computes in float32 vector
code, so fresh chunks of FLASH_FRESH_MIN_TOKENS or more take the flash path (SmolLM2 on a 2-core
Xeon, a whole prefill step: 768 tokens 244 ms against 283, 1,056 tokens 319-330 against 397-408,
2,048 tokens 658 against 973; up to 512 tokens the two were even). So do they, in either dtype,
where the kernel has no AVX-512 tiles (kernels.cpu_paged_prefill_attention.has_vector_tiles) and
computes a query row at a time (SmolLM2 on a 2-core AMD Zen 3, float32: 768 tokens 1,498 ms against
2,055, 1,024 tokens 2,047 against 3,139; bfloat16, 1,024 tokens 2,144 against 3,265; up to 512
tokens even).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata
from engine.attention.windowed import WindowedAttention, needs_exact_attention
from kernels import cpu_paged_decode_attention as cpu_kernel
from kernels import cpu_paged_prefill_attention as cpu_prefill
from kernels._cpu_build import cpu_flags
from kernels._cpu_paged import heads_contiguous


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _padding_mask(seq_lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(num_seqs, 1, 1, max_len) additive mask: 0 on each sequence's keys, -inf past its length."""
    positions = torch.arange(max_len, device=seq_lens.device)
    past_end = positions[None, :] >= seq_lens.to(torch.long)[:, None]
    mask = torch.zeros(past_end.shape, dtype=dtype, device=seq_lens.device).masked_fill_(
        past_end, float("-inf")
    )
    return mask[:, None, None, :]


# Padding every decode to the step's longest context wastes about half of the gather and attention
# work when lengths are spread out; sorted into groups of similar length, four groups waste about a
# quarter. Beyond that the extra launches cost more than the padding saved.
_MAX_DECODE_GROUPS = 4
_MIN_DECODE_GROUP_SIZE = 8


@dataclass(slots=True)
class _DecodePlan:
    rows: torch.Tensor | None  # (num_decodes,) query rows; None when they are every row of the step
    blocks: torch.Tensor  # (num_decodes * max_blocks,) int64 block ids, one padded table per row
    max_len: int  # longest context among the decodes
    mask: torch.Tensor  # (num_decodes, 1, 1, max_len)


@dataclass(slots=True)
class _ChunkPlan:
    start: int  # query rows [start, end)
    end: int
    seq_len: int
    blocks: torch.Tensor | None  # int64 block ids of the context; None for a fresh prompt chunk
    mask: torch.Tensor | None  # (q_len, seq_len) additive causal mask offset by the cached tokens


@dataclass(slots=True)
class _KernelDecodes:
    """The decode rows of a mixed step, for the CPU kernel."""

    rows: torch.Tensor  # (num_decodes,) int64 query rows
    block_tables: torch.Tensor  # (num_decodes, max_blocks) int32
    seq_lens: torch.Tensor  # (num_decodes,) int32


@dataclass(slots=True)
class _StepPlan:
    decodes: list[_DecodePlan] = field(default_factory=list)
    chunks: list[_ChunkPlan] = field(default_factory=list)
    kernel_decodes: _KernelDecodes | None = None
    kernel_chunks: cpu_prefill.ChunkTable | None = None  # the prompt chunks, for the CPU kernel


def _plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    max_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :max_blocks].to(torch.long).reshape(-1)
    return blocks, _padding_mask(seq_lens, max_len, dtype)


def _group_by_length(lens: list[int]) -> list[list[int]]:
    """Indices into lens in runs of similar length, or one run in order when grouping saves little."""
    num_groups = min(_MAX_DECODE_GROUPS, len(lens) // _MIN_DECODE_GROUP_SIZE)
    if num_groups > 1:
        order = sorted(range(len(lens)), key=lens.__getitem__)
        size = -(-len(order) // num_groups)
        groups = [order[i : i + size] for i in range(0, len(order), size)]
        padded = sum(len(g) * lens[g[-1]] for g in groups)
        if padded < 0.8 * len(lens) * max(lens):
            return groups
    return [list(range(len(lens)))]


def _plan_decodes(
    metadata: AttentionMetadata, seqs: list[int], rows: list[int] | None, block_size: int, dtype: torch.dtype
) -> list[_DecodePlan]:
    """Decode plans for sequences `seqs` of the step, whose query rows are `rows` (None: all rows)."""
    device = metadata.block_tables.device
    lens = [metadata.seq_lens_cpu[i] for i in seqs]
    groups = _group_by_length(lens)
    if rows is None and len(groups) == 1:
        blocks, mask = _plan_decode(metadata.block_tables, metadata.seq_lens, max(lens), block_size, dtype)
        return [_DecodePlan(None, blocks, max(lens), mask)]
    plans = []
    for group in groups:
        index = torch.tensor([seqs[j] for j in group], dtype=torch.long, device=device)
        max_len = max(lens[j] for j in group)
        blocks, mask = _plan_decode(
            metadata.block_tables.index_select(0, index),
            metadata.seq_lens.index_select(0, index),
            max_len,
            block_size,
            dtype,
        )
        group_rows = index if rows is None else torch.tensor([rows[j] for j in group], device=device)
        plans.append(_DecodePlan(group_rows, blocks, max_len, mask))
    return plans


FLASH_FRESH_MIN_TOKENS = 768


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles (Linux's cpuinfo flag amx_bf16)."""
    return "amx_bf16" in cpu_flags()


def plan_step(
    metadata: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    decode_kernel: bool = False,
    prefill_kernel: bool = False,
    flash_fresh_min: int | None = None,
) -> _StepPlan:
    """Everything about a step's layout that does not depend on the layer. With ``decode_kernel``
    the decode rows are left to the CPU kernel (kernel_decodes) instead of gather plans, and with
    ``prefill_kernel`` the prompt chunks to the CPU prefill kernel (kernel_chunks), except, with
    ``flash_fresh_min``, fresh chunks of at least that many tokens (torch's flash attention).

    Off CPU, a decode-only step is planned from device tensors and the host max_seq_len only, as
    one group, so that it can be captured in a CUDA graph (whose host lengths are upper bounds).
    Otherwise the host copies of the lengths are read.
    """
    device = metadata.block_tables.device
    if metadata.is_pure_decode:
        if device.type != "cpu":
            max_len = metadata.max_seq_len
            blocks, mask = _plan_decode(metadata.block_tables, metadata.seq_lens, max_len, block_size, dtype)
            return _StepPlan([_DecodePlan(None, blocks, max_len, mask)])
        return _StepPlan(_plan_decodes(metadata, list(range(metadata.num_seqs)), None, block_size, dtype))
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    chunks: list[_ChunkPlan] = []
    kernel_chunks: list[tuple[int, int, int, int]] = []  # (sequence, first row, q_len, seq_len)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
        end = start + q_len
        flash = flash_fresh_min is not None and q_len == seq_len and q_len >= flash_fresh_min
        if q_len == 1:
            decode_rows.append(start)
            decode_seqs.append(i)
        elif q_len > 1 and prefill_kernel and not flash:
            kernel_chunks.append((i, start, q_len, seq_len))
        elif q_len == seq_len:
            chunks.append(_ChunkPlan(start, end, seq_len, None, None))
        elif q_len > 1:
            blocks = metadata.block_tables[i, : -(-seq_len // block_size)].to(torch.long)
            # Query j sits at absolute position seq_len - q_len + j and sees keys up to there.
            rows = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
            future = torch.arange(seq_len, device=device)[None, :] > rows  # (q_len, seq_len)
            mask = torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(future, float("-inf"))
            chunks.append(_ChunkPlan(start, end, seq_len, blocks, mask))
        start = end
    table = cpu_prefill.ChunkTable(*map(list, zip(*kernel_chunks, strict=True))) if kernel_chunks else None
    if decode_rows and decode_kernel:
        index = torch.tensor(decode_seqs, dtype=torch.long, device=device)
        kernel = _KernelDecodes(
            torch.tensor(decode_rows, dtype=torch.long, device=device),
            metadata.block_tables.index_select(0, index),
            metadata.seq_lens.index_select(0, index).to(torch.int32),
        )
        return _StepPlan([], chunks, kernel, table)
    decodes = _plan_decodes(metadata, decode_seqs, decode_rows, block_size, dtype) if decode_rows else []
    return _StepPlan(decodes, chunks, None, table)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        # The plans of the step in progress, keyed by its metadata objects: every layer of a
        # forward receives the same one, or one of two where windowed layers have a view of their
        # own (AttentionMetadata.windowed). Kept only on CPU, since a CUDA graph must rebuild them
        # on replay.
        self._plans: dict[int, tuple[AttentionMetadata, _StepPlan]] = {}
        self._workspaces: dict[str, torch.Tensor] = {}
        # The C kernels on CPU: None until the first CPU forward asks whether they compiled. Tests
        # set them False to run the torch paths.
        self.use_cpu_kernel: bool | None = None
        self.use_cpu_prefill_kernel: bool | None = None
        # Long fresh chunks to torch's flash attention instead of the prefill kernel: None, in
        # bfloat16 on a CPU with AMX (FLASH_FRESH_MIN_TOKENS); tests set it True or False.
        self.flash_fresh_chunks: bool | None = None
        self._windowed = WindowedAttention()  # Gemma's windowed and soft-capped layers

    def _decode_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if q.device.type != "cpu":
            return False
        if self.use_cpu_kernel is None:
            self.use_cpu_kernel = cpu_kernel.available()
        return self.use_cpu_kernel and cpu_kernel.supports(q, k_cache)

    def _prefill_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if q.device.type != "cpu":
            return False
        if self.use_cpu_prefill_kernel is None:
            self.use_cpu_prefill_kernel = cpu_prefill.available()
        return self.use_cpu_prefill_kernel and cpu_prefill.supports(q, k_cache)

    def _flash_fresh_min(self, q: torch.Tensor, prefill_kernel: bool) -> int | None:
        if not prefill_kernel:
            return None  # every chunk takes the torch paths already
        flash = self.flash_fresh_chunks
        if flash is None:
            flash = (q.dtype == torch.bfloat16 and cpu_has_amx_bf16()) or not cpu_prefill.has_vector_tiles()
        return FLASH_FRESH_MIN_TOKENS if flash else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        kv_stored: bool = False,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``kv_stored``: the caller already wrote k and v into the caches (a fused CPU pass).
        ``window`` and ``softcap``: see engine.attention.windowed."""
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if needs_exact_attention(metadata, window, softcap):
            return self._windowed(
                q,
                k_cache,
                v_cache,
                metadata,
                scale,
                window,
                softcap,
                decode_kernel=self._decode_kernel(q, k_cache),
            )
        kernel = self._decode_kernel(q, k_cache)
        if kernel and metadata.is_pure_decode:
            return cpu_kernel.paged_decode_attention_cpu(
                heads_contiguous(q), k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale
            )
        prefill_kernel = self._prefill_kernel(q, k_cache)
        plan = self._step_plan(
            metadata,
            k_cache.shape[1],
            q.dtype,
            q.device,
            kernel,
            prefill_kernel,
            self._flash_fresh_min(q, prefill_kernel),
        )
        if len(plan.decodes) == 1 and plan.decodes[0].rows is None:
            return self._decode(q, k_cache, v_cache, plan.decodes[0], scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.kernel_chunks is not None:
            cpu_prefill.paged_prefill_attention_cpu(
                heads_contiguous(q),
                k_cache,
                v_cache,
                metadata.block_tables,
                plan.kernel_chunks,
                scale,
                out=out,
            )
        if plan.kernel_decodes is not None:
            d = plan.kernel_decodes
            cpu_kernel.paged_decode_attention_cpu(
                heads_contiguous(q),
                k_cache,
                v_cache,
                d.block_tables,
                d.seq_lens,
                scale,
                rows=d.rows,
                out=out,
            )
        for decode in plan.decodes:
            rows = decode.rows
            assert rows is not None, "the decodes of a mixed step name their rows"
            out.index_copy_(0, rows, self._decode(q.index_select(0, rows), k_cache, v_cache, decode, scale))
        for chunk in plan.chunks:
            out[chunk.start : chunk.end] = self._chunk(q, k, v, k_cache, v_cache, chunk, scale)
        return out

    def _step_plan(
        self,
        metadata: AttentionMetadata,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        decode_kernel: bool = False,
        prefill_kernel: bool = False,
        flash_fresh_min: int | None = None,
    ) -> _StepPlan:
        if device.type != "cpu":
            return plan_step(metadata, block_size, dtype)
        held = self._plans.get(id(metadata))
        if held is None or held[0] is not metadata:
            if len(self._plans) >= 2:
                self._plans.clear()
            plan = plan_step(metadata, block_size, dtype, decode_kernel, prefill_kernel, flash_fresh_min)
            held = (metadata, plan)
            self._plans[id(metadata)] = held
        return held[1]

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
        """cache[blocks], on CPU into a workspace reused by every layer and step."""
        if cache.device.type != "cpu":
            return cache.index_select(0, blocks)
        shape = (blocks.numel(), *cache.shape[1:])
        numel = math.prod(shape)
        buf = self._workspaces.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype:
            # Headroom, so that contexts growing a block at a time do not reallocate every step.
            buf = torch.empty(numel + numel // 4, dtype=cache.dtype)
            self._workspaces[name] = buf
        out = buf[:numel].view(shape)
        torch.index_select(cache, 0, blocks, out=out)
        return out

    def _decode(self, q, k_cache, v_cache, plan: _DecodePlan, scale: float) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        padded = plan.blocks.numel() // num_seqs * block_size
        # (num_seqs, max_len, num_kv_heads, head_dim) -> (num_seqs, num_kv_heads, max_len, head_dim)
        keys = self._gather(k_cache, plan.blocks, "k").view(num_seqs, padded, num_kv_heads, head_dim)
        values = self._gather(v_cache, plan.blocks, "v").view(num_seqs, padded, num_kv_heads, head_dim)
        keys = keys[:, : plan.max_len].transpose(1, 2)
        values = values[:, : plan.max_len].transpose(1, 2)
        queries = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _chunk(self, q, k, v, k_cache, v_cache, chunk: _ChunkPlan, scale: float) -> torch.Tensor:
        q_len = chunk.end - chunk.start
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        # (q_len, num_heads, head_dim) -> (num_kv_heads, group, q_len, head_dim). Keys and values
        # are expanded (stride 0) over the group instead of repeated; 4-D inputs take torch's
        # flash kernel on CPU, where 3-D ones fall back to the unfused math path.
        queries = q[chunk.start : chunk.end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        if chunk.blocks is None:
            keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        else:
            keys = k_cache.index_select(0, chunk.blocks).flatten(0, 1)[: chunk.seq_len]
            values = v_cache.index_select(0, chunk.blocks).flatten(0, 1)[: chunk.seq_len]
        shape = (num_kv_heads, group, keys.shape[0], head_dim)
        keys = keys.transpose(0, 1)[:, None].expand(shape)
        values = values.transpose(0, 1)[:, None].expand(shape)
        if chunk.mask is None:
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
