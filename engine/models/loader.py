"""Load a Hugging Face model directory (single or sharded safetensors) into engine.models.llama, offline."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend
from engine.models.config import ModelConfig, ModelLoadError, load_model_config
from engine.models.llama import PACKED_HINT_ROWS, LlamaForCausalLM, LlamaMLP, packed_linear
from engine.models.moe import SparseMoeBlock
from engine.models.rope import rope_inv_freq

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$")
# One expert's projections: Mixtral's w1 (gate), w3 (up), w2 (down); Qwen3-MoE's named ones.
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# All experts in one tensor each, as transformers 5 holds them in memory.
_EXPERTS_3D = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$"
)
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
# Buffers some exporters write; they are recomputed here.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: malformed index ({exc!r})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found (.bin checkpoints are not loaded)")
    return files


def _expert_slot(cfg: ModelConfig, name: str) -> tuple[str, tuple[int, ...] | None] | None:
    """(parameter name, index into it) for a mixture-of-experts tensor, else None: the router is
    the layer's mlp.gate, an expert's projections slices of mlp.w13 (gate rows, then up rows)
    and mlp.w2."""
    if not cfg.moe_layers:
        return None
    if m := _ROUTER.match(name):
        return f"model.layers.{m.group(1)}.mlp.gate.weight", None
    if m := _EXPERTS_3D.match(name):
        return f"model.layers.{m.group(1)}.mlp.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}", None
    m = _EXPERT.match(name)
    if m is None:
        return None
    layer, expert, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj in ("w2", "down_proj"):
        return f"model.layers.{layer}.mlp.w2", (expert,)
    half = 0 if proj in ("w1", "gate_proj") else 1
    return f"model.layers.{layer}.mlp.w13", (expert, half)


def _fused_slot(cfg: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """(fused parameter name, row offset, rows) for a q/k/v or gate/up tensor, else None."""
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, proj, kind = m.groups()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    offsets = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    fused, start, rows = offsets[proj]
    return f"model.layers.{layer}.{fused}.{kind}", start, rows


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    from safetensors import safe_open

    cfg = model.config
    params = dict(model.named_parameters())
    # Every element of every parameter must be written exactly once; count them per parameter.
    filled = {name: 0 for name in params}
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{path}: unreadable safetensors file ({exc})") from exc
        with handle as f:
            for name in f.keys():
                if _IGNORED.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                tensor = f.get_tensor(name)
                expert = _expert_slot(cfg, name)
                slot = _fused_slot(cfg, name) if expert is None else None
                target_name, start, rows = slot if slot else (name if expert is None else expert[0], 0, None)
                if target_name not in params:
                    raise ModelLoadError(f"{path.name}: unexpected tensor {name!r} for {cfg.architecture}")
                target = params[target_name].data
                if rows is not None:
                    target = target[start : start + rows]
                if expert is not None and expert[1] is not None:
                    if expert[1][0] >= target.shape[0]:
                        raise ModelLoadError(f"{path.name}: {name!r} names an expert beyond num_experts")
                    target = target[expert[1][0]]
                    if len(expert[1]) == 2:  # w13: the gate rows, then the up rows
                        half = target.shape[0] // 2
                        target = target[expert[1][1] * half : (expert[1][1] + 1) * half]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"{path.name}: {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                filled[target_name] += tensor.numel()
    incomplete = [n for n, p in params.items() if filled[n] != p.numel()]
    if incomplete:
        raise ModelLoadError(f"{model_dir}: checkpoint is missing or duplicates weights for {incomplete[:5]}")


def resolve_dtype(requested: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    name = cfg.torch_dtype if requested == "auto" else requested
    if name not in ("float32", "bfloat16", "float16"):
        name = "float32"
    # On CPU, auto means float32 whatever the checkpoint holds: float16 matmuls are slow and lossy
    # there, and bfloat16 ones without AMX run at about half the float32 rate, which makes whole runs
    # slower in bfloat16 for this engine and for vLLM's CPU build alike (bench/RESULTS.md).
    if requested == "auto" and device.type == "cpu" and name in ("float16", "bfloat16"):
        name = "float32"
    return getattr(torch, name)


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    *,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
) -> LlamaForCausalLM:
    """Build the model from config.json on ``device`` and fill it from the safetensors files.
    `max_model_len`: the longest context it will serve (LlamaForCausalLM)."""
    root = Path(model_dir)
    cfg = load_model_config(root)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, dev)
    # Parameters are created on the meta device so no time is spent on random init of weights that
    # are overwritten right away.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_model_len)
    model = model.to_empty(device=dev).to(torch_dtype)
    # The rotary buffer was left empty on meta; frequencies stay float32 whatever the weights' dtype.
    model.rotary.inv_freq = rope_inv_freq(
        cfg.rotary_dims, cfg.rope_theta, cfg.rope_scaling, long_context=model.long_rope
    ).to(dev)
    if model.rotary_local is not None and cfg.local_rope_theta is not None:
        model.rotary_local.inv_freq = rope_inv_freq(cfg.rotary_dims, cfg.local_rope_theta, None).to(dev)
    load_weights(model, root)
    if dev.type == "cpu":
        _cpu_linears(model, torch_dtype)
        _column_major_linears(model)
    return model.eval()


class _CpuLinear(nn.Linear):
    """A decoder linear on CPU, with faster paths than plain F.linear where they apply.

    - Batches of up to ``packed_max_rows`` rows multiply by a copy of the weight that oneDNN packed
      once at load time (``packed``): MKL repacks the weight on every call, which at a few dozen
      rows costs about a fifth of the multiply, and oneDNN's kernels beat MKL's sgemm at every
      width (float32 on SmolLM2's shapes: 40% faster at 64 rows, 30-40% at 128 to 2,048). vLLM's
      CPU backend runs its linears the same way. Float32 weights, and bfloat16 ones where the CPU
      has bfloat16 dot products (AVX512-BF16 or AMX), take it at every width; other bfloat16 only
      for decode-sized batches, where oneDNN emulates the dot products no slower than the rest.
    - bfloat16 weights beyond that: wide batches (prefill chunks, from ``FLOAT32_MIN_ROWS`` rows)
      multiply in float32, the weight widened for the call (cheap next to the multiply it speeds
      up) and the result rounded back: without bfloat16 dot products a bfloat16 GEMM runs at about
      half the float32 rate. The products of bfloat16 values are exact in float32 and bfloat16
      GEMMs accumulate in float32 too, so only the order of the sums differs.
    """

    FLOAT32_MIN_ROWS = 128
    packed: torch.Tensor | None = None
    packed_max_rows = 0
    wide_float32 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else -1
        if self.packed is not None and 0 < rows <= self.packed_max_rows:
            return packed_linear(x, self.packed, self.bias)
        if self.wide_float32 and rows >= self.FLOAT32_MIN_ROWS:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(torch.bfloat16)
        return F.linear(x, self.weight, self.bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a (out, in) weight, or None where this torch build cannot make one."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKED_HINT_ROWS)
    except (RuntimeError, AttributeError):
        return None


def packed_max_rows(dtype: torch.dtype) -> int:
    """The widest batch a packed weight of `dtype` is used for (see _CpuLinear)."""
    if dtype == torch.float32:
        return sys.maxsize
    if dtype == torch.bfloat16 and _native_bfloat16():
        return sys.maxsize
    return PACKED_HINT_ROWS


def _native_bfloat16() -> bool:
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def _packed_weights_budget() -> int:
    """Bytes of packed weight copies an engine may add (PAGODA_CPU_PACKED_WEIGHTS; 0: none)."""
    return int(os.environ.get("PAGODA_CPU_PACKED_WEIGHTS", str(4 * 1024**3)))


def _cpu_linears(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    linears = list(_decoder_linears(model))
    logits_weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    extra = sum(t.numel() * t.element_size() for t in [*(m.weight for m in linears), logits_weight])
    pack = extra <= _packed_weights_budget()
    max_rows = packed_max_rows(dtype)
    for plain in linears:
        plain.__class__ = _CpuLinear
        linear = cast(_CpuLinear, plain)
        linear.wide_float32 = dtype == torch.bfloat16
        if pack:
            linear.packed = pack_weight(linear.weight)
            linear.packed_max_rows = max_rows
    if pack:
        model.packed_logits_weight = pack_weight(logits_weight)
        model.packed_max_rows = max_rows
    experts = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    expert_bytes = sum(t.numel() * t.element_size() for m in experts for t in (m.w13, m.w2))
    if experts and dtype == torch.float32 and extra + expert_bytes <= _packed_weights_budget():
        # Each expert's block of tokens is a narrow batch: packed weights, as for the linears.
        for block in experts:
            w13 = [pack_weight(w) for w in block.w13]
            w2 = [pack_weight(w) for w in block.w2]
            if all(p is not None for p in w13 + w2):
                block.packed_w13 = cast(list[torch.Tensor], w13)
                block.packed_w2 = cast(list[torch.Tensor], w2)


def _decoder_linears(model: LlamaForCausalLM) -> Iterator[nn.Linear]:
    layer: Any
    for layer in model.model.layers:
        yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
        if isinstance(layer.mlp, LlamaMLP):
            yield from (layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _column_major_linears(model: LlamaForCausalLM) -> None:
    """Store each decoder linear's weight (out, in) column-major: F.linear multiplies by its
    transpose, which is then a plain row-major (in, out) matrix, and MKL's sgemm runs its faster
    no-transpose kernel (decode steps about 5% faster on SmolLM2). Same values, same memory.
    Linears whose packed copy serves every width never multiply by the plain weight: it stays
    row-major, the layout the one-call decode layers read (kernels.cpu_decode_layer)."""
    for linear in _decoder_linears(model):
        if (
            isinstance(linear, _CpuLinear)
            and linear.packed is not None
            and linear.packed_max_rows == sys.maxsize
        ):
            continue
        linear.weight.data = linear.weight.data.t().contiguous().t()
