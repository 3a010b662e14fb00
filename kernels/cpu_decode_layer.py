"""A decoder layer of a decode step in one C call (kernels/cpu/decode_layer.c): norms, the four
products, the rotary embedding, the K/V store and paged attention, in one OpenMP parallel region per
layer. In float32 a step may have up to `max_rows()` sequences: 256 where the library is built with
AVX-512, 16 with AVX2 and FMA, 8 with neither. In bfloat16, up to `max_rows(torch.bfloat16)`: 256
where the CPU has AVX512-BF16's dot products (Zen 4 and later, Intel since Cooper Lake), else none.

Layer by layer, a decode step pays dispatch beside its products: per layer four oneDNN calls, four
fused kernels with their wrappers and a dozen module calls (about 3.5 ms of a 15 ms step at one
sequence on SmolLM2's 30 layers, 2-core EPYC), and OpenMP threads that wait between regions. On a
2-core Xeon, SmolLM2's float32 decode steps with 300 tokens of context took 33.9, 45.1, 65.0 and
113 ms at 9, 16, 32 and 64 sequences, against 42.8, 52.6, 73.8 and 120 layer by layer.
`DecodeLayers` checks the weights once, when it is made, and a step's inputs once per step, then
calls the kernel once per layer.

The kernel checks the slots, block tables and lengths before it writes anything (as the paged
kernels do) and raises through kernels._cpu_paged.raise_for_status. `available()` is False where
the library cannot be built; the model then keeps its layer-by-layer path. The reference is that
path (engine.models.llama.LlamaDecoderLayer).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels import _cpu_build, _cpu_paged

_BAD_SLOT = 6  # DECODE_BAD_SLOT

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = {
    "decode_layer": (
        ctypes.c_int,
        [
            _P,  # x (rows, hidden), the residual stream, updated in place
            _P,  # delta (rows, hidden), nullable: the previous layer's MLP output
            _P,  # out_delta (rows, hidden): this layer's MLP output
            _I64,  # rows
            _I64,  # hidden
            _I64,  # intermediate
            _P,  # input norm weight
            _P,  # post-attention norm weight
            ctypes.c_float,  # eps
            _P,  # w_qkv
            _P,  # b_qkv (nullable)
            _P,  # w_o
            _P,  # w_gate_up
            _P,  # w_down
            _P,  # cos (rows, head_dim)
            _P,  # sin_signed (rows, head_dim)
            _P,  # slots (rows,) int64
            _P,  # k_cache
            _P,  # v_cache
            _I64,  # num_blocks
            ctypes.c_int,  # block_size
            _P,  # block_tables (rows, bt_stride) int32
            _I64,  # bt_stride
            _I64,  # bt_width
            _P,  # seq_lens (rows,) int32
            ctypes.c_int,  # num_heads
            ctypes.c_int,  # num_kv_heads
            ctypes.c_int,  # head_dim
            ctypes.c_float,  # scale
            ctypes.c_int,  # is_bf16
            ctypes.c_int,  # num_threads
        ],
    ),
    "decode_layer_max_rows": (ctypes.c_int, []),
    "decode_layer_max_rows_bf16": (ctypes.c_int, []),
}

DTYPES = (torch.float32, torch.bfloat16)


def _load() -> ctypes.CDLL | None:
    return _cpu_build.load("decode_layer", _SIGNATURES)


def available() -> bool:
    return _load() is not None


# With AMX, oneDNN's bfloat16 products multiply on the tiles, far faster than the kernel's vector dot
# products once a step has rows enough to fill them; there the one-call layers take the narrow steps
# alone, which stream the weights once and where dispatch is most of what the kernel saves (at one
# sequence a third of the step). Wider bfloat16 steps have not been measured against AMX.
AMX_BF16_MAX_ROWS = 8


def max_rows(dtype: torch.dtype = torch.float32) -> int:
    """The widest decode step the built kernel takes in `dtype` (0 where it cannot be built, or takes
    none of that dtype): in float32 256 with AVX-512, 16 with AVX2 and FMA, 8 with neither; in
    bfloat16 256 with AVX512-BF16 (AMX_BF16_MAX_ROWS where the CPU has AMX), else 0."""
    lib = _load()
    if lib is None or dtype not in DTYPES:
        return 0
    if dtype == torch.float32:
        return int(lib.decode_layer_max_rows())
    widest = int(lib.decode_layer_max_rows_bf16())
    return min(widest, AMX_BF16_MAX_ROWS) if _has_amx() else widest


def _has_amx() -> bool:
    check = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else False


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights, all float32 or all bfloat16, contiguous: norms (hidden,), qkv
    (q + 2 kv, hidden) with an optional bias, o (hidden, q), gate_up (2 inter, hidden: gate rows,
    then up rows), down (hidden, inter)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecodeLayers:
    """The decoder layers of a float32 or bfloat16 model as one kernel call each, for steps of decode
    rows only (one new token per sequence, at most `max_rows` of them). Activations, caches and
    rotary tables are in the weights' dtype."""

    def __init__(
        self,
        layers: Sequence[LayerWeights],
        *,
        eps: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ) -> None:
        lib = _load()
        if lib is None:
            raise RuntimeError("the CPU decode layer kernel is not available")
        if not layers:
            raise ValueError("no layers")
        self._fn = lib.decode_layer
        self.dtype = layers[0].qkv.dtype
        self.max_rows = max_rows(self.dtype)
        if self.max_rows < 1:
            raise ValueError(f"the CPU decode layer kernel takes no {self.dtype} steps on this machine")
        hidden = layers[0].input_norm.shape[0]
        inter = layers[0].down.shape[1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        shapes = {
            "input_norm": (hidden,),
            "post_attention_norm": (hidden,),
            "qkv": (q_size + 2 * kv_size, hidden),
            "o": (hidden, q_size),
            "gate_up": (2 * inter, hidden),
            "down": (hidden, inter),
        }
        for i, layer in enumerate(layers):
            tensors = {name: getattr(layer, name) for name in shapes}
            if layer.qkv_bias is not None:
                tensors["qkv_bias"] = layer.qkv_bias
            for name, t in tensors.items():
                want = shapes.get(name, (q_size + 2 * kv_size,))
                if (
                    t.device.type != "cpu"
                    or t.dtype != self.dtype
                    or not t.is_contiguous()
                    or t.shape != want
                ):
                    raise ValueError(
                        f"layer {i} {name}: {tuple(t.shape)} {t.dtype} is not a contiguous {self.dtype} {want}"
                    )
        self.layers = tuple(layers)  # holds the weights the pointers below point into
        self._weights = [
            (
                layer.input_norm.data_ptr(),
                layer.post_attention_norm.data_ptr(),
                layer.qkv.data_ptr(),
                None if layer.qkv_bias is None else layer.qkv_bias.data_ptr(),
                layer.o.data_ptr(),
                layer.gate_up.data_ptr(),
                layer.down.data_ptr(),
            )
            for layer in layers
        ]
        self.hidden, self.inter, self.eps = hidden, inter, float(eps)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = float(scale)
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._cache_ptrs: list[tuple[int, int]] = []
        self._cache_geometry = (0, 0)

    def _check_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The caches' layout, checked once per list of caches (the engine keeps one)."""
        if kv_caches is self._caches:
            return
        if len(kv_caches) != len(self._weights):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self._weights)} layers")
        want = (self.num_kv_heads, self.head_dim)
        first = kv_caches[0][0]
        for k, v in kv_caches:
            if (
                k.dtype != self.dtype
                or k.dim() != 4
                or tuple(k.shape[2:]) != want
                or k.shape != first.shape
                or v.shape != k.shape
                or v.dtype != k.dtype
                or not (k.is_contiguous() and v.is_contiguous())
            ):
                raise ValueError(
                    f"the KV caches must be contiguous {self.dtype} (blocks, block_size, kv_heads, head_dim)"
                )
        self._cache_ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        self._cache_geometry = (first.shape[0], first.shape[1])
        self._caches = kv_caches

    def forward(
        self,
        x: torch.Tensor,  # (rows, hidden) in the weights' dtype, the residual stream: updated in place
        cos: torch.Tensor,  # (rows, head_dim)
        sin_signed: torch.Tensor,  # (rows, head_dim): sin with its first half negated
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: torch.Tensor,  # (rows,) int64
        block_tables: torch.Tensor,  # (rows, max_blocks) int32
        seq_lens: torch.Tensor,  # (rows,) int32, each including its new token
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:  # (rows, hidden): the last layer's MLP output, for the final norm to add
        """`between`: called before every layer but the first (it may raise to give the step up:
        engine.step_interrupt)."""
        rows = x.shape[0]
        if (
            not 0 < rows <= self.max_rows
            or x.dtype != self.dtype
            or x.shape != (rows, self.hidden)
            or not x.is_contiguous()
        ):
            raise ValueError(
                f"decode layers: x must be (1..{self.max_rows}, {self.hidden}) contiguous {self.dtype}"
            )
        table_shape = (rows, self.head_dim)
        for t in (cos, sin_signed):
            if t.dtype != self.dtype or t.shape != table_shape or not t.is_contiguous():
                raise ValueError(
                    f"decode layers: cos and sin_signed must be (rows, head_dim) contiguous {self.dtype}"
                )
        if (
            slot_mapping.dtype != torch.int64
            or slot_mapping.shape != (rows,)
            or not slot_mapping.is_contiguous()
        ):
            raise ValueError("decode layers: slot_mapping must be (rows,) contiguous int64")
        if seq_lens.dtype != torch.int32 or seq_lens.shape != (rows,) or not seq_lens.is_contiguous():
            raise ValueError("decode layers: seq_lens must be (rows,) contiguous int32")
        if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != rows:
            raise ValueError("decode layers: block_tables must be (rows, max_blocks) int32")
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        self._check_caches(kv_caches)
        num_blocks, block_size = self._cache_geometry
        buffers = (torch.empty_like(x), torch.empty_like(x))
        ptrs = (buffers[0].data_ptr(), buffers[1].data_ptr())
        x_ptr, cos_ptr, sin_ptr = x.data_ptr(), cos.data_ptr(), sin_signed.data_ptr()
        slots_ptr, tables_ptr, lens_ptr = (
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
        )
        bt_stride, bt_width = block_tables.stride(0), block_tables.shape[1]
        threads = torch.get_num_threads()
        delta_ptr = None
        fn = self._fn
        is_bf16 = int(self.dtype == torch.bfloat16)
        for i, ((ln1, ln2, qkv, qkv_bias, o, gate_up, down), (k_ptr, v_ptr)) in enumerate(
            zip(self._weights, self._cache_ptrs, strict=True)
        ):
            if i and between is not None:
                between()
            out_ptr = ptrs[i % 2]
            status = fn(
                x_ptr, delta_ptr, out_ptr, rows, self.hidden, self.inter, ln1, ln2, self.eps,
                qkv, qkv_bias, o, gate_up, down, cos_ptr, sin_ptr, slots_ptr, k_ptr, v_ptr,
                num_blocks, block_size, tables_ptr, bt_stride, bt_width, lens_ptr,
                self.num_heads, self.num_kv_heads, self.head_dim, self.scale, is_bf16, threads,
            )  # fmt: skip
            if status == _BAD_SLOT:
                raise IndexError("decode layer: a slot lies outside the KV cache (nothing was written)")
            if status:
                _cpu_paged.raise_for_status(status, "decode layer", "activations")
            delta_ptr = out_ptr
        return buffers[(len(self._weights) - 1) % 2]
