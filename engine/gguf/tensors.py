"""GGUF tensors as Hugging Face checkpoint tensors: names, row order and dequantization.

Most GGUF tensors are one Hugging Face parameter each. llama.cpp's phi3 keeps Phi-3's fused
projections as Phi-3's checkpoints do; its mixtures of experts merge each projection of a layer's
experts into one (experts, rows, cols) tensor, which becomes one parameter per expert again (the
checkpoint layout transformers and other engines read). Gemma's norm weights are stored plus one
(engine.gguf.gemma) and come back as the offsets its checkpoints hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from engine.gguf.config import FAMILIES, architecture, family
from engine.gguf.fields import GGUFImportError, field_value
from engine.gguf.gemma import GEMMA_ARCHITECTURES
from engine.gguf.rope import ROPE_TENSORS

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_NORMS_AND_OUTPUT = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_output": "self_attn.o_proj",
}
_QKV = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA = _NORMS_AND_OUTPUT | _QKV | _MLP
# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm before the MLP, not after attention.
_GEMMA = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_output": "self_attn.o_proj",
    **_QKV,
    **_MLP,
}
# attn_qkv holds the q, k and v rows; llama.cpp's phi3 has no ffn_gate: ffn_up holds the gate rows,
# then the up rows, as gate_up_proj does.
_PHI3 = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
# Each family's layer tensors (blk.N.<part>.weight|bias) -> Hugging Face parameter of layer N. A
# tensor a family does not list has no place in its model.
_LAYER: dict[str, dict[str, str]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA | _QK_NORM,
    "phi3": _NORMS_AND_OUTPUT | _PHI3,
    "mixtral": _NORMS_AND_OUTPUT | _QKV | {"ffn_gate_inp": "block_sparse_moe.gate"},
    # Its dense layers (mlp_only_layers) keep an MLP.
    "qwen3moe": _LLAMA | _QK_NORM | {"ffn_gate_inp": "mlp.gate"},
    "gemma2": _GEMMA,
    "gemma3": _GEMMA | _QK_NORM,
}
# Where each expert's gate, up and down projections go.
_EXPERTS = {
    "mixtral": ("block_sparse_moe.experts", {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}),
    "qwen3moe": ("mlp.experts", {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}),
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# blk.N.ffn_gate_exps.weight: all experts of a layer (llama.cpp since 2024); blk.N.ffn_gate.E.weight:
# expert E alone (older files).
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)(?:_exps|\.(\d+))\.weight$")


def _is_merged(tensor: Any) -> bool:
    m = _EXPERT_NAME.match(tensor.name)
    return m is not None and m.group(3) is None


def hf_names(tensor: Any, fam: str) -> list[str]:
    """The Hugging Face parameter(s) a GGUF tensor holds: one, or one per expert for merged experts."""
    name = tensor.name
    if name in _GLOBAL:
        return [_GLOBAL[name]]
    m = _EXPERT_NAME.match(name)
    if m is not None and fam in _EXPERTS:
        prefix, projections = _EXPERTS[fam]
        layer, proj, expert = m.groups()
        if expert is None and len(tensor.shape) != 3:
            raise GGUFImportError(
                f"tensor {name!r} has {len(tensor.shape)} dimensions, not (experts, rows, cols)"
            )
        experts = [int(expert)] if expert is not None else range(int(tensor.shape[-1]))
        return [f"model.layers.{layer}.{prefix}.{e}.{projections[proj]}.weight" for e in experts]
    m = _LAYER_NAME.match(name)
    if m is None or m.group(2) not in _LAYER[fam]:
        raise GGUFImportError(f"tensor {name!r} has no counterpart in the engine's {fam} models")
    layer, part, kind = m.groups()
    return [f"model.layers.{layer}.{_LAYER[fam][part]}.{kind}"]


def readable_types() -> set[str]:
    """Tensor encodings this importer can dequantize (gguf-py's numpy implementations)."""
    from gguf import GGMLQuantizationType, quants

    return {"F32", "F16"} | {t.name for t in quants._type_traits} | {GGMLQuantizationType.BF16.name}


def check_tensors(reader: Any) -> None:
    """Refuse, before anything is written, a file with tensors this importer cannot read or place."""
    readable = readable_types()
    unreadable = sorted({t.tensor_type.name for t in reader.tensors} - readable)
    if unreadable:
        raise GGUFImportError(
            f"quantization type(s) {', '.join(unreadable)} cannot be read "
            f"(readable: {', '.join(sorted(readable))})"
        )
    fam = family(reader)
    for tensor in reader.tensors:
        if tensor.name not in ROPE_TENSORS:
            hf_names(tensor, fam)
    if not any(t.name == "token_embd.weight" for t in reader.tensors):
        raise GGUFImportError("the GGUF file has no token_embd.weight (token embeddings)")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows: per head, (pairs, 2) back to (2, pairs)."""
    rows = w.shape[0]
    # (n_head, head_dim // 2, 2, ...) -> (n_head, 2, head_dim // 2, ...)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(tensor: Any, expert: int | None = None) -> np.ndarray:
    """The tensor in float32, shaped as PyTorch shapes it (GGUF lists dimensions innermost first).
    With `expert`, only that expert of merged (experts, rows, cols) experts: one expert at a time
    in memory (Mixtral's merged tensors are 2 GB each in float32)."""
    from gguf import quants

    data = tensor.data  # quantized rows are whole blocks, so the first axis slices as experts
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if expert is not None:
        data, shape = data[expert], shape[1:]
    return np.asarray(quants.dequantize(data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def rope_tensors(reader: Any) -> dict[str, np.ndarray]:
    """The file's tensors that are rope scaling (engine.gguf.rope), by name."""
    return {t.name: dequantized(t) for t in reader.tensors if t.name in ROPE_TENSORS}


def weight_count(reader: Any) -> int:
    """How many values iter_hf_tensors yields."""
    return sum(int(t.n_elements) for t in reader.tensors if t.name not in ROPE_TENSORS)


def _arrays(tensor: Any, names: list[str]) -> Iterator[np.ndarray]:
    if _is_merged(tensor):
        yield from (dequantized(tensor, e) for e in range(len(names)))
    else:
        yield dequantized(tensor)


def iter_hf_tensors(reader: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype``) for every weight, one at a time (bounded memory)."""
    arch, fam = architecture(reader), family(reader)
    permuted = FAMILIES[fam][2]
    norm_plus_one = fam in GEMMA_ARCHITECTURES
    heads = field_value(reader, f"{arch}.attention.head_count")
    kv_heads = field_value(reader, f"{arch}.attention.head_count_kv", heads)
    heads = heads[0] if isinstance(heads, list) else heads
    kv_heads = kv_heads[0] if isinstance(kv_heads, list) else kv_heads
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue
        names = hf_names(t, fam)
        for name, w in zip(names, _arrays(t, names), strict=True):
            if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_rows(w, heads)
            elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_rows(w, kv_heads)
            elif norm_plus_one and name.endswith("norm.weight"):
                w = w - np.float32(1.0)  # in float32, as the GGUF holds it, before any narrowing
            if not w.flags.writeable or not w.flags.c_contiguous:  # float32 tensors are views of the mmap
                w = np.array(w, order="C")
            yield name, torch.from_numpy(w).to(dtype)
