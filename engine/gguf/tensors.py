"""GGUF tensors as Hugging Face checkpoint tensors: names, row order and dequantization."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from engine.gguf.config import ARCHITECTURES, GGUFImportError, architecture, field_value

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp stores Llama 3.1's rope scaling as this tensor; it becomes config, not a weight.
ROPE_FREQS = "rope_freqs.weight"


# Tensors only some architectures have.
_ONLY_IN = {"attn_q_norm": ("qwen3",), "attn_k_norm": ("qwen3",)}


def hf_name(name: str, arch: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _LAYER_NAME.match(name)
    if m is None or m.group(2) not in _LAYER or arch not in _ONLY_IN.get(m.group(2), (arch,)):
        raise GGUFImportError(f"tensor {name!r} has no counterpart in the engine's {arch} models")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER[part]}.{kind}"


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
    names = [t.name for t in reader.tensors]
    arch = architecture(reader)
    for name in names:
        if name != ROPE_FREQS:
            hf_name(name, arch)
    if "token_embd.weight" not in names:
        raise GGUFImportError("the GGUF file has no token_embd.weight (token embeddings)")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows: per head, (pairs, 2) back to (2, pairs)."""
    rows = w.shape[0]
    # (n_head, head_dim // 2, 2, ...) -> (n_head, 2, head_dim // 2, ...)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(tensor: Any) -> np.ndarray:
    """The tensor in float32, shaped as PyTorch shapes it (GGUF lists dimensions innermost first)."""
    from gguf import quants

    data = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def rope_freqs(reader: Any) -> np.ndarray | None:
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            return dequantized(t)
    return None


def iter_hf_tensors(reader: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype``) for every weight, one at a time (bounded memory)."""
    arch = architecture(reader)
    permuted = ARCHITECTURES[arch][2]
    heads = field_value(reader, f"{arch}.attention.head_count")
    kv_heads = field_value(reader, f"{arch}.attention.head_count_kv", heads)
    heads = heads[0] if isinstance(heads, list) else heads
    kv_heads = kv_heads[0] if isinstance(kv_heads, list) else kv_heads
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        name = hf_name(t.name, arch)
        w = dequantized(t)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, kv_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:  # float32 tensors are views of the mmap
            w = np.array(w, order="C")
        yield name, torch.from_numpy(w).to(dtype)
