"""Gemma 2 and Gemma 3 (text) GGUF files as the config.json fields the engine and transformers read.

llama.cpp's converter (Gemma2Model, Gemma3Model in convert_hf_to_gguf.py) keeps some of Gemma's
hyper-parameters as fields and leaves others to llama.cpp's loader, which assumes them. This module
writes what that loader assumes, which is what the released models are:

- Sliding windows. gemma2: `attention.sliding_window` (4096 without it) on every other layer from
  the first. gemma3: `attention.sliding_window` on five of every six layers (the last of each six
  attends fully); a model without a window has no such field, or 0, and attends fully on every
  layer. Neither converter stores the layer pattern; where a file does state
  `attention.sliding_window_pattern` it is followed, as a period (as newer llama.cpp reads it for
  Gemma 2) or as one flag per layer (as Ollama's own converter writes it for Gemma 3).
- Soft caps. gemma2: `attn_logit_softcapping` and `final_logit_softcapping` (50 and 30 without
  them). gemma3: none, unless the file states them.
- Rotary bases. gemma2: one `rope.freq_base` for all layers, which its converter does not write
  (10000, Gemma 2's). gemma3: `rope.freq_base` and `rope.scaling.type`/`factor` are the full
  layers' (linear, factor 8, on Gemma 3 4B and up); the sliding layers turn a plain rotation of
  base `rope.freq_base_swa` where newer converters write it (`rope.local.freq_base` in Ollama's
  own Gemma 3 files), else the 10000 llama.cpp fixes.
- The attention scale. query_pre_attn_scalar is not stored: llama.cpp scales queries by
  1/sqrt(head_dim), except on the 27B models (picked by layer count: 46 for Gemma 2, 62 for
  Gemma 3), where it takes 1/sqrt(hidden_size / heads). Those are the released models' scalars
  (256, the head size, and 144 and 168 for the 27Bs). A model trained with another scalar cannot be
  told from the file: it imports as llama.cpp runs it.

The weights: the converter adds one to every norm weight (Gemma's RMSNorm computes x * (1 + w),
llama.cpp's x * w), which engine.gguf.tensors subtracts again. The converter adds it in the
checkpoint's dtype, so the offsets of a bfloat16 checkpoint come back as rounded by that addition:
the weights llama.cpp computes with. Q and K rows keep the Hugging Face order, and the output
projection is the token embedding (Gemma 2's converter drops lm_head; Gemma 3 ties it). Gemma 3's
converter also cuts the embedding to the tokenizer's size, which becomes the import's vocab_size.
"""

from __future__ import annotations

from typing import Any

from engine.gguf.fields import GGUFImportError, field_value

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# The block count by which llama.cpp recognises the 27B models and takes hidden_size / heads as
# their query scalar.
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's period of sliding layers: every layer but the last of each period slides.
_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA2_WINDOW = 4096
_GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA3_LOCAL_BASE = 10000.0


def query_pre_attn_scalar(arch: str, *, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The query scalar llama.cpp computes with (see the module docstring)."""
    return hidden // heads if layers == _27B_LAYERS[arch] else head_dim


def _sliding(reader: Any, arch: str, layers: int) -> list[bool]:
    """Which layers slide: the file's sliding_window_pattern, else llama.cpp's period."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = field_value(reader, key, _PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, (bool, int)) for p in pattern):
            raise GGUFImportError(f"{key} must give one flag per layer ({layers}), got {pattern!r}")
        return [bool(p) for p in pattern]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise GGUFImportError(f"{key} must be a period or one flag per layer, got {pattern!r}")
    # llama.cpp's llama_hparams::set_swa_pattern: period 0 slides everywhere, 1 nowhere.
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def _window(reader: Any, arch: str) -> int | None:
    """The sliding window in tokens; None: a Gemma 3 without one (every layer attends fully)."""
    key = f"{arch}.attention.sliding_window"
    window = field_value(reader, key)
    if arch == "gemma2" and window is None:
        return _GEMMA2_WINDOW
    if arch == "gemma3" and not window:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise GGUFImportError(f"{key} must be a positive integer, got {window!r}")
    return window


def _softcaps(reader: Any, arch: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        default = _GEMMA2_SOFTCAPS[name] if arch == "gemma2" else None
        value = field_value(reader, f"{arch}.{name}", default)
        if value is not None and not float(value) > 0:
            raise GGUFImportError(f"{arch}.{name} must be positive, got {value!r}")
        out[name] = None if value is None else float(value)
    return out


def gemma_fields(
    reader: Any, arch: str, *, layers: int, hidden: int, heads: int, head_dim: int, theta: float
) -> dict[str, Any]:
    """Gemma 2/3's config.json fields beyond the Llama ones; `theta`: the file's rope.freq_base."""
    window = _window(reader, arch)
    sliding = _sliding(reader, arch, layers) if window is not None else [False] * layers
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar(
            arch, layers=layers, hidden=hidden, heads=heads, head_dim=head_dim
        ),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        **_softcaps(reader, arch),
    }
    if window is not None:
        out["sliding_window"] = window
    local = field_value(
        reader, f"{arch}.rope.freq_base_swa", field_value(reader, f"{arch}.rope.local.freq_base")
    )
    if arch == "gemma3":
        out["rope_local_base_freq"] = _GEMMA3_LOCAL_BASE if local is None else float(local)
    elif local is not None and float(local) != theta:
        raise GGUFImportError(
            f"the file gives the sliding layers a rotary base of {local} and the others {theta}; "
            "Gemma 2 has one base for all layers"
        )
    return out
